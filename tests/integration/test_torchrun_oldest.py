"""The shutdown window on the oldest supported PyTorch, inside a "container", on the Debian-like local cluster of
test_torchrun_debian.py (issue 16). Its torchrun cannot be told the window (no --shutdown-timeout): the workers get
the stop themselves, so a 45 s checkpoint survives where torchrun would SIGKILL it after 30 s; the job is requeued
and resumes at the right step. The container is a stand-in for pyxis' `srun --container-image` that runs the node's
part with the image's programs (the old PyTorch's venv) first on PATH, so the version check really happens inside
the image. What is old here is torchrun (the CUDA build of 2.1 takes ~3 s of CPU to import here, per process): the
workers are test_torchrun.py's torch-free stand-in, run by the image's Python beside its torch; workers that train
over gloo through the whole window are in test_torchrun_debian.py."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from torchjob import (NEEDS_HOST_VIEW, NEEDS_TORCH, OLDEST_TORCH, STAND_IN, Job, checkpoint_across_the_time_limit,
                      debian_site, oldest_torch_venv)

pytestmark = [NEEDS_TORCH, NEEDS_HOST_VIEW]

# pyxis stand-in: `srun --container-image=IMAGE --container-mounts=...` runs the step with IMAGE/bin first on PATH
# (IMAGE is a venv here), and records the mounts it was asked for.
PYXIS_SRUN = """#!/bin/bash
args=()
image=
for a in "$@"; do
  case "$a" in
    --container-image=*) image=${a#--container-image=} ;;
    --container-mounts=*) printf '%s\\n' "${a#--container-mounts=}" >>"$PYXIS_LOG" ;;
    --container-workdir=*) ;;
    *) args+=("$a") ;;
  esac
done
if [ -n "$image" ]; then
  export PATH="$image/bin:$PATH"
fi
exec REAL_SRUN "${args[@]}"
"""


@pytest.mark.slow(80)  # the old torchrun's start, a 45 s checkpoint, a second attempt
def test_the_window_holds_on_the_oldest_pytorch_inside_a_container(site_factory, tmp_path):
    """Issue 16: the oldest supported PyTorch's torchrun has no --shutdown-timeout, and with container_image set the
    check used to be skipped (it ran outside the image). The node's wrapper checks the torchrun inside the image,
    and since this one cannot be told the window, sends SIGTERM to the workers themselves: the 45 s checkpoint
    survives where torchrun would have SIGKILLed it after 30 s."""
    image = oldest_torch_venv()  # the "container image": the old PyTorch's venv
    site = debian_site(site_factory, nodes=2)
    stubs = tmp_path / "pyxis"
    stubs.mkdir()
    (stubs / "srun").write_text(PYXIS_SRUN.replace("REAL_SRUN", shutil.which("srun") or "/usr/bin/srun"))
    (stubs / "srun").chmod(0o755)
    mounts_log = tmp_path / "mounts.log"
    jobs = site.cluster.jobs_dir
    path = f"{stubs}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    # The stop request comes through the batch script's USR1 trap, as Slurm's time-limit warning does (that timer is
    # exercised in test_torchrun_debian.py); sent here by hand once both ranks train, since the CUDA build of the old
    # PyTorch takes a while to start on 2 cores and Slurm's timer could fire before. Sent minutes before the time
    # limit, it is an admin's stop, and the ledger calls it that (issue 29: never "time_limit").
    job = Job(site, sbatch_args=[f"--export=ALL,PATH={path},PYXIS_LOG={mounts_log}"], train=STAND_IN, steps=100000,
              step_time=1.0, time_limit="10", requeue_grace_s=100, max_failures=0, save_delay=45,
              torchrun="torchrun", container_image=str(image), container_mounts=[f"{jobs}:{jobs}"])
    job.wait_for(lambda: job.output().count("training steps") >= 2, "both ranks to train", timeout=180)
    time.sleep(2)
    assert site.cluster.run(["scancel", "--batch", "--signal=USR1", job.id]).returncode == 0
    _info, out, ledger = checkpoint_across_the_time_limit(site, job, stop=("manual_stop", "stop"))
    assert "stopped from outside long before the time limit" in ledger[0]["detail"], ledger[0]
    assert "this torchrun has no --shutdown-timeout" in out, out[-4000:]
    assert f"beside torch {OLDEST_TORCH}" in out  # the workers report the PyTorch of the image they run in
    # the job directory, the node-local scratch root and the checkpoint's file system were mounted
    mounts = mounts_log.read_text().split()
    assert mounts and all(f"{jobs}:{jobs}" in m and f"{site.workdir / 'local'}:" in m for m in mounts), mounts
