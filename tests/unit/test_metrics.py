"""Prometheus text files from real runs (the runner over a simulated node through the fake NVML), read back with
prometheus-client's own parser, as node_exporter's textfile collector would."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.config import parse_config
from gpuguard.context import RunContext
from gpuguard.metrics import Family, write_families, write_run_metrics
from gpuguard.runner import execute
from gpuguard.slurm import NodeState

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"


class MemorySlurm:
    """The SlurmClient seam: a node that is up and takes a drain."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None

    def get_node(self, name: str) -> Optional[NodeState]:
        return NodeState(name=name, states=frozenset({"IDLE", "DRAIN"} if self.reason else {"IDLE"}),
                         reason=self.reason)

    def drain(self, name: str, reason: str) -> None:
        self.reason = reason

    def undrain(self, name: str) -> None:
        self.reason = None


def make_cfg(tmp_path, textfile_dir: Optional[str]):
    from gpuguard.simulate.build import build_fake_nvml

    data = {"store": {"path": str(tmp_path / "state" / "{node}.db")},
            "simulation": {"workdir": str(tmp_path / "sim"), "fake_nvml": str(build_fake_nvml())},
            "logging": {"syslog": False}}
    if textfile_dir:
        data["metrics"] = {"textfile_dir": textfile_dir}
    return parse_config(yaml.safe_dump(data), source="test")


def read_metrics(path: Path) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(metrics, name, **labels):
    matches = [v for lab, v in metrics[name] if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, metrics.get(name))
    return matches[0]


def test_prolog_drain_run_metrics_parse(tmp_path):
    prom = tmp_path / "textfile" / "{node}"
    cfg = make_cfg(tmp_path, str(prom))
    slurm = MemorySlurm()
    ctx = RunContext(kind="prolog", node="node2", job_id="77", gpu_indices=tuple(range(8)))
    result = execute(ctx, cfg, simulate=str(SCENARIOS / "xid79.yaml"), slurm_client=slurm)
    assert result.verdict.outcome == "drain" and slurm.reason
    # no explicit call: every prolog/epilog/health-check run writes its metrics (runner.tell_humans)

    node_dir = tmp_path / "textfile" / "node2"
    m = read_metrics(node_dir / "gpuguard_prolog.prom")
    assert value(m, "gpuguard_run_verdict", kind="prolog", verdict="drain") == 1
    assert value(m, "gpuguard_run_verdict", kind="prolog", verdict="pass") == 0
    assert value(m, "gpuguard_run_exit_code", node="node2", kind="prolog") == 1
    assert value(m, "gpuguard_check_severity", check="gpu.xid") == 3
    assert value(m, "gpuguard_check_severity", check="gpu.temperature") == 0
    assert 0 < value(m, "gpuguard_probe_duration_seconds", probe="nvml") < 10
    assert value(m, "gpuguard_drain_operations_total", op="drain", outcome="done") == 1
    xid = read_metrics(node_dir / "gpuguard_xid.prom")
    assert value(xid, "gpuguard_xid_events_total", node="node2", code=79) == 1
    assert [p.name for p in node_dir.iterdir()] and not [p for p in node_dir.iterdir() if p.name.startswith(".")]

    # the next health check: the Xid was judged already (cursor), the counter keeps its value
    execute(RunContext(kind="healthcheck", node="node2"), cfg, simulate=str(SCENARIOS / "healthy-p5.yaml"),
                 slurm_client=slurm)
    m2 = read_metrics(node_dir / "gpuguard_healthcheck.prom")
    assert value(m2, "gpuguard_run_verdict", kind="healthcheck", verdict="pass") == 1
    assert value(read_metrics(node_dir / "gpuguard_xid.prom"), "gpuguard_xid_events_total", code=79) == 1
    assert (node_dir / "gpuguard_prolog.prom").exists()  # one file per source


def test_not_configured_writes_and_imports_nothing(tmp_path):
    code = (
        "import sys, yaml\n"
        "from gpuguard.config import parse_config\n"
        "from gpuguard.metrics import write_run_metrics\n"
        "cfg = parse_config('')\n"
        "write_run_metrics(cfg, None)\n"
        "print('prometheus_client' in sys.modules, 'sqlite3' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["False", "False"], p.stderr


def test_never_raises_on_an_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = make_cfg(tmp_path, str(blocker / "sub"))
    result = execute(RunContext(kind="healthcheck", node="n1"), cfg, simulate=str(SCENARIOS / "healthy-p5.yaml"),
                     dry_run=True)
    write_run_metrics(cfg, result)  # logs, does not raise


def test_atomic_replace_never_shows_a_partial_file(tmp_path):
    fams = [Family("gpuguard_test_value", "gauge", "test")]
    for i in range(300):
        fams[0].add(i, gpu=i, node="n1")
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        path = tmp_path / "gpuguard_monitor.prom"
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            n = sum(1 for f in text_string_to_metric_families(text) for _ in f.samples)
            if n != 300:
                bad.append(f"{n} samples")

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(50):
        write_families(str(tmp_path), "monitor", fams)
    stop.set()
    t.join()
    assert bad == []
    assert sorted(os.listdir(tmp_path)) == ["gpuguard_monitor.prom"]


def test_label_values_are_escaped(tmp_path):
    fam = Family("gpuguard_check_severity", "gauge", 'help with "quotes"')
    fam.add(3, node='n"1\n', check="gpu\\xid")
    write_families(str(tmp_path), "prolog", [fam])
    m = read_metrics(tmp_path / "gpuguard_prolog.prom")
    assert m["gpuguard_check_severity"][0][0] == {"node": 'n"1\n', "check": "gpu\\xid"}


@pytest.mark.parametrize("kind", ["gauge", "counter"])
def test_counter_and_gauge_names(tmp_path, kind):
    fam = Family("gpuguard_things_total" if kind == "counter" else "gpuguard_things", kind, "h")
    fam.add(5, node="n")
    write_families(str(tmp_path), "x", [fam])
    names = {s.name for f in text_string_to_metric_families((tmp_path / "gpuguard_x.prom").read_text())
             for s in f.samples}
    assert "gpuguard_things_total" in names if kind == "counter" else names == {"gpuguard_things"}
