"""No user can change, hide or break a series gpuguard's root hooks write (issue 29 item 5), tried as the real
user nobody: root's textfile directory is root's alone, the job monitor writes in a 1777 directory of its own, and
root forwards only the monitor's own series into its directory. The directory is read as node_exporter's
textfile collector does (every *.prom merged; a series in two files fails the scrape)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from test_metrics import MemorySlurm, collect_dir, make_cfg, promtool_check_metrics, run

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as the real user nobody")

MONITOR_TEXT = """# HELP gpuguard_gpu_temperature_celsius GPU temperature
# TYPE gpuguard_gpu_temperature_celsius gauge
gpuguard_gpu_temperature_celsius{node="node2",gpu="0"} 61.0
# HELP gpuguard_monitor_alert alerts
# TYPE gpuguard_monitor_alert gauge
gpuguard_monitor_alert{node="node2",job_id="42",kind="hang",check="monitor.progress",severity="critical"} 1.0
"""
FORGED = """# HELP gpuguard_node_drained forged
# TYPE gpuguard_node_drained gauge
gpuguard_node_drained{node="node2"} 0.0
# HELP gpuguard_gpu_info forged
# TYPE gpuguard_gpu_info gauge
gpuguard_gpu_info{node="node2",gpu="0"} 1.0
"""


def as_nobody(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    base = Path(tempfile.mkdtemp(prefix="gg-prom-"))
    base.chmod(0o755)
    textfile, monitor = base / "textfile", base / "monitor"
    textfile.mkdir(mode=0o755)
    monitor.mkdir()
    monitor.chmod(0o1777)
    try:
        yield textfile, monitor
    finally:
        shutil.rmtree(base, ignore_errors=True)


def drained(series: dict) -> list[float]:
    return [v for (name, labels), v in series.items() if name == "gpuguard_node_drained"]


def test_a_user_cannot_hide_a_drain_nor_break_the_scrape(tmp_path, dirs):
    textfile, monitor = dirs
    cfg = make_cfg(tmp_path, str(textfile), monitor_dir=str(monitor))
    slurm = MemorySlurm()
    run(cfg, "healthcheck", "xid79", slurm)
    assert drained(collect_dir(textfile)) == [1.0]

    # the user's evil.prom cannot land where node_exporter reads
    p = as_nobody(f"printf '%s' '{FORGED}' > {textfile}/evil.prom")
    assert p.returncode != 0 and not (textfile / "evil.prom").exists()
    # in the monitor's directory it may, with the monitor's series around it
    p = as_nobody(f"printf '%s%s' '{MONITOR_TEXT}' '{FORGED}' > {monitor}/gpuguard_monitor.prom")
    assert p.returncode == 0, p.stderr
    run(cfg, "healthcheck", "xid79", slurm)  # root forwards the monitor's series at every run
    series = collect_dir(textfile)  # fails on a series in two files: the scrape would fail
    assert drained(series) == [1.0]
    assert series[("gpuguard_gpu_temperature_celsius", frozenset({("node", "node2"), ("gpu", "0")}))] == 61.0
    forwarded = (textfile / "gpuguard_monitor.prom").read_text()
    assert "gpuguard_node_drained" not in forwarded and "gpuguard_gpu_info" not in forwarded
    promtool_check_metrics(textfile / "gpuguard_monitor.prom")

    # a file that does not parse costs the monitor's series, never the scrape
    as_nobody(f"rm -f {monitor}/gpuguard_monitor.prom; printf 'garbage {{{{ 1\\n' > {monitor}/gpuguard_monitor.prom")
    run(cfg, "healthcheck", "xid79", slurm)
    assert sorted(p.name for p in textfile.glob("*.prom")) == ["gpuguard_node.prom"]
    assert drained(collect_dir(textfile)) == [1.0]


def test_root_refuses_a_world_writable_textfile_directory(tmp_path, dirs):
    """The old layout (textfile_dir 1777 so the monitor could write there): root writes nothing a user could
    shadow; `gpuguard config --check` says why (tests/unit/test_fs.py)."""
    _, monitor = dirs
    cfg = make_cfg(tmp_path, str(monitor))
    run(cfg, "healthcheck", "xid79", MemorySlurm())
    assert not (monitor / "gpuguard_node.prom").exists()


def test_the_monitors_names_are_its_own(tmp_path):
    """Root forwards exactly the monitor's names, and none of them is a name root writes itself."""
    from gpuguard.metrics.heartbeat import watch_families
    from gpuguard.metrics.monitorfiles import MONITOR_NAMES
    from gpuguard.monitor.detect import Alert
    from gpuguard.monitor.metrics import monitor_families

    report = {"node": "n", "job_id": "1", "ts": 1.0, "interval_s": 10.0, "last_iteration": 1, "last_progress": 1.0,
              "step_time_s": 1.0, "monitor_cpu_s": 1.0, "host": {},
              "gpus": [{"index": 0, "util_pct": 1, "mem_used_mib": 1, "mem_total_mib": 1, "temp_c": 1,
                        "temp_slowdown_c": 1, "power_w": 1, "sm_clock_mhz": 1, "sm_clock_max_mhz": 1,
                        "mem_clock_mhz": 1, "throttle_mask": 0}]}
    mine = {f.name for f in monitor_families(report, [Alert("hang", "monitor.progress", "critical", "x")],
                                             {"rss_bytes": 1.0})}
    assert mine == MONITOR_NAMES
    run(make_cfg(tmp_path, str(tmp_path / "prom")), "healthcheck", "xid79", MemorySlurm())
    roots = {name for name, _ in collect_dir(tmp_path / "prom")}
    roots |= {f.name for f in watch_families("n", 1.0, 1.0, 30.0, True, 0)}
    assert roots and not roots & MONITOR_NAMES
