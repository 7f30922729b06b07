"""Config validation that a fleet can rely on (issue 9): no infinite/NaN deadlines, no alias bombs, and the
hooks' own deadline covers loading the config."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuguard.config import ConfigError, parse_config


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
    assert cfg.sections["node"]["overrides"] == {"gpu_count": 8}
    assert cfg.check_params("gpu.temperature", {})["warn_c"] == 80


def test_hook_deadline_covers_a_hung_config_file(tmp_path):
    """A config on a hung filesystem (a FIFO nobody writes to blocks open() the same way): the prolog gives up,
    fails open (exit 0: no policy could be read) and says so in its log, instead of hanging until slurmd's own
    timeout."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    env = {"PATH": "/usr/bin:/bin", "GPUGUARD_CONFIG_LOAD_TIMEOUT_S": "1", "SLURMD_NODENAME": "n1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gpuguard", "prolog", "--config", str(fifo)], env=env,
                       capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 0
    assert took < 5, took
    assert "config-loading deadline of 1s exceeded" in p.stderr
