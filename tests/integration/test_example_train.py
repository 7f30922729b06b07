"""examples/train.py, the training script docs/templates.md shows, follows the contract the torchrun template relies
on: run by a real torchrun (CPU PyTorch, gloo, 2 processes), SIGTERM stops every rank at the same step with one
complete checkpoint, a resume continues from it, and a bad configuration exits with its own code, which gpuguard
reads from torchrun's report. No Slurm: the template's side is in test_torchrun*.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torchjob import NEEDS_TORCH, newest_torchrun

from gpuguard.templates.checkpoint import find_checkpoint
from gpuguard.templates.torchrun_report import parse_torchrun_failures

pytestmark = NEEDS_TORCH

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def _torchrun_standalone(args, tmp_path, name):
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([newest_torchrun(), "--standalone", "--nproc-per-node=2", "--tee=3", str(EXAMPLE), *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}), \
        tmp_path / f"{name}.log"


@pytest.mark.slow(25)  # three torchrun runs
def test_the_example_training_script_follows_the_contract(tmp_path):
    """examples/train.py: SIGTERM to every process (what scancel --signal=TERM does) stops all ranks at the same
    step with one complete checkpoint (marker last); a resume continues from it; a bad configuration exits with
    the code meant for no_retry_exit_codes, which gpuguard reads from torchrun's report."""
    ckpt = tmp_path / "ckpt"
    proc, log = _torchrun_standalone(["--ckpt-dir", str(ckpt), "--steps", "100000", "--step-time", "0.05",
                                      "--checkpoint-every", "100000"], tmp_path, "run1")
    deadline = time.monotonic() + 120
    while log.read_text().count("training steps") < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    out = log.read_text()
    stops = sorted({line.split("stopping at step ")[1].split()[0] for line in out.splitlines()
                    if "stopping at step " in line})
    assert len(stops) == 1 and out.count("stopping at step") == 2, out[-3000:]  # both ranks, the same step
    found = find_checkpoint(str(ckpt), "glob", "step-*", "COMPLETE")
    assert found and found.step == int(stops[0]) and not list(ckpt.glob(".tmp-*"))
    # resume: continues after the stop step and finishes
    proc, log = _torchrun_standalone(["--ckpt-dir", str(ckpt), "--steps", str(found.step + 3), "--resume",
                                      str(found.path)], tmp_path, "run2")
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert f"resumed at step {found.step}" in out and f"finished {found.step + 3} steps" in out
    # a configuration error: its own exit code, recovered from torchrun's report (torchrun itself exits 1)
    p = subprocess.run([newest_torchrun(), "--standalone", "--nproc-per-node=1", str(EXAMPLE), "--ckpt-dir", str(ckpt),
                        "--lr", "-1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and [w.exit_code for w in parse_torchrun_failures(p.stdout + p.stderr)] == [2]
