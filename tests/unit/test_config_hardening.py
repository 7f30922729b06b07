"""Config validation that a fleet can rely on (issue 9): no infinite/NaN deadlines, no alias bombs, and the
hooks' own deadline covers loading the config."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuguard.config.schema import ConfigError
from gpuguard.siteconfig import parse_config

from simnode import SCENARIOS


@pytest.mark.parametrize("text,key", [
    ("deadlines:\n  prolog_s: .nan\n", "deadlines.prolog_s"),
    ("deadlines:\n  nvml_s: .inf\n", "deadlines.nvml_s"),
    ("deadlines:\n  healthcheck_s: -.inf\n", "deadlines.healthcheck_s"),
    ("checks:\n  gpu.memory: {tolerance_pct: .NaN}\n", "checks.gpu.memory.tolerance_pct"),
    ("undrain:\n  window_h: .Inf\n", "undrain.window_h"),
])
def test_non_finite_numbers_are_refused_with_key_and_line(text, key):
    with pytest.raises(ConfigError) as e:
        parse_config(text, source="/etc/gpuguard/config.yaml")
    msg = str(e.value)
    assert f"line 2: {key}:" in msg and "finite" in msg, msg


def _billion_laughs() -> str:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 10):
        prev, cur = chr(96 + i), chr(97 + i)
        lines.append(f"{cur}: &{cur} [{', '.join(['*' + prev] * 10)}]")
    return "node:\n  overrides:\n" + "".join(f"    {line}\n" for line in lines)


def test_alias_bomb_is_refused_fast():
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="expands to more than .* aliases"):
        parse_config(_billion_laughs(), source="c.yaml")
    assert time.monotonic() - t0 < 1.0


def test_modest_anchors_still_work():
    text = "checks:\n  gpu.temperature: &t {warn_c: 80}\n  gpu.throttle: {warn_reasons: [sw_thermal]}\n" \
           "node:\n  overrides: &o {gpu_count: 8}\nmonitor: {disk_paths: [/, /tmp]}\n"
    cfg = parse_config(text, source="c.yaml")
    assert cfg.node.overrides == {"gpu_count": 8}
    assert cfg.check_params("gpu.temperature", {})["warn_c"] == 80


def test_hook_deadline_covers_a_hung_config_file(tmp_path):
    """A config on a hung filesystem (a FIFO nobody writes to blocks open() the same way): the prolog stops waiting
    for it, runs with the last good configuration instead (here: a simulated Xid 79 node, drained) and says why in
    its log, instead of hanging until slurmd's own timeout or failing open."""
    import yaml

    from gpuguard.siteconfig import load_guarded
    from gpuguard.simulate.build import build_fake_nvml

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({
        "store": {"path": str(tmp_path / "state" / "{node}.db"), "runtime_dir": str(tmp_path / "run")},
        "simulation": {"scenario": str(SCENARIOS / "xid79.yaml"), "workdir": str(tmp_path / "sim"),
                       "fake_nvml": str(build_fake_nvml())},
        "logging": {"syslog": False}, "policy": {"on_failure": "report"}}))
    fifo = tmp_path / "config.yaml"
    env = {"PATH": "/usr/bin:/bin", "GPUGUARD_CONFIG_LOAD_TIMEOUT_S": "1", "SLURMD_NODENAME": "n1",
           "GPUGUARD_STATE_DIR": str(tmp_path / "lastgood"), "SLURM_JOB_ID": "5"}
    os.environ["GPUGUARD_STATE_DIR"] = env["GPUGUARD_STATE_DIR"]
    try:  # the file as it was when it last validated, at the path the hook reads
        os.symlink(good, fifo)
        assert load_guarded(str(fifo)).mode == "ok"
    finally:
        del os.environ["GPUGUARD_STATE_DIR"]
    fifo.unlink()
    os.mkfifo(fifo)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gpuguard", "prolog", "--config", str(fifo)], env=env,
                       capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    assert took < 8, took
    assert "did not finish within 1s" in p.stderr and "last good configuration" in p.stderr, p.stderr
    assert "verdict=warn" in p.stderr and "XID79" in p.stderr, p.stderr  # judged (report-only: nothing to drain)
