"""The torchrun template end to end on a real local Slurm cluster (devtools.devsite: munge, slurmctld, one
slurmd per node, gpuguard's prolog) with a real torchrun: CPU PyTorch, gloo, 2 nodes x 1 process, a tiny model
that checkpoints every step (tests/fixtures/templates/tiny_train.py). Faults are injected through files the
training reads, and through gpuguard's own health check draining a node with simulated Xid 79.

What a user would notice is asserted: the job's final state and restart count (scontrol show job), where each
attempt ran, the ledger in the job directory, the `attempts` table in the user-side store (templates.store_path,
never the hooks' store), the training output (resumed from which step) and the node-local scratch directory.

These run on the dev cluster as it is by default (every node at 127.0.0.1, this machine's host name); the shutdown
window on the newest and the oldest supported PyTorch, containers, and the rendezvous on a host laid out like a
stock Debian node are in test_torchrun_debian.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from torchjob import NEEDS_TORCH, Job, configure

pytestmark = NEEDS_TORCH

@pytest.mark.slow(40)  # two attempts, each starting torch on two nodes
def test_failed_attempt_is_requeued_and_resumes_from_its_checkpoint_in_private_scratch(site_factory):
    """Also issue 9: TRITON_CACHE_DIR under a predictable /tmp/gpuguard-<jobid> could be pre-created by another user.
    Here another user planted gpuguard-1 (this cluster's first job id): each node of each attempt makes a fresh
    private mktemp directory instead (0700, the job user's), gpuguard's epilog removes the job's directories and
    leaves the squatter's alone. (The predictable name itself, when free: the no-retry test below.)"""
    site = site_factory(nodes=3, epilog=True)
    local = configure(site)
    squatted = local / "gpuguard-1"
    squatted.mkdir()
    squatted.chmod(0o777)
    os.chown(squatted, 65534, 65534)
    (squatted / "planted.py").write_text("print('owned')\n")
    t0 = time.monotonic()
    job = Job(site, max_requeues=2)
    assert job.id == "1"
    (job.control / "fail-step-4").touch()  # rank 0 raises at step 4 of the first attempt
    info = job.wait()
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.why(info)
    ledger = job.ledger()
    assert [(r["attempt"], r["reason"], r["action"]) for r in ledger] == [
        (1, "app_error", "requeued"), (2, "completed", "finished")], ledger
    assert ledger[0]["exit_code"] != 0 and ledger[1]["exit_code"] == 0
    # attempt 2 got the newest complete checkpoint (step 3) on its command line and continued from there
    assert ledger[1]["resumed_from"].endswith("step-000003")
    assert "resumed from step 3" in out and "finished 6 steps" in out
    assert "injected failure at step 4" in out
    assert (job.ckpt / "DONE").read_text() == "6"
    rows = job.store_attempts()
    assert [(r["attempt"], r["reason"], r["action"], r["nodes"]) for r in rows] == [
        (1, "app_error", "requeued", ledger[0]["nodes"]), (2, "completed", "finished", ledger[1]["nodes"])]
    assert ledger[0]["nodes"] == "node[1-2]" and rows[0]["exit_code"] == ledger[0]["exit_code"]
    # the scratch: never the squatter's directory, a private one per node and attempt, gone after the job
    assert "is not a private directory" in out
    seen = [line.split("LOCAL_DIR ")[1].split() for line in out.splitlines() if "LOCAL_DIR " in line]
    assert len(seen) == 4, out[-3000:]  # one line per node and attempt
    for path, _mode_kw, mode, _uid_kw, uid, *_ in seen:
        assert Path(path).parent == local and Path(path).name.startswith("gpuguard-1.") and mode == "0o700"
        assert uid == str(os.getuid())
    job.wait_for(lambda: not any(Path(p[0]).exists() for p in seen), "the epilog to remove the scratch", 30)
    assert squatted.is_dir() and (squatted / "planted.py").exists()  # someone else's: left alone
    print(f"fail -> requeue -> resume -> finish: {time.monotonic() - t0:.1f}s")


@pytest.mark.slow(18)
def test_a_worker_exit_code_in_the_no_retry_list_is_not_retried(site_factory):
    """Issue 10: torchrun exits 1 whatever its worker's code, so no_retry_exit_codes never matched. The worker's
    own code (3, from torchrun's root-cause report) is recorded and matched.

    Also issue 9, the predictable scratch name when nobody took it: gpuguard-<jobid>, private, removed by the
    epilog after the job."""
    site = site_factory(nodes=2, epilog=True)
    local = configure(site)
    job = Job(site, max_failures=3, no_retry_exit_codes=[3])
    (job.control / "exit-3-rank-1").touch()
    info = job.wait()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.why(info)
    assert info["ExitCode"].startswith("3:"), job.why(info)
    ledger = job.ledger()
    assert [(r["reason"], r["action"]) for r in ledger] == [("no_retry", "gave_up")], job.why(info)
    rec = ledger[0]
    # srun's own code is 1 (torchrun's), 143 or 137 (the other node's torchrun stopped by SIGTERM / SIGKILL),
    # whichever srun reports: exactly why the worker's code has to come from torchrun's report
    assert (rec["worker_exit_code"], rec["worker_rank"]) == (3, 1) and rec["exit_code"] in (1, 137, 143), rec
    assert "rank 1" in rec["detail"] and "exited with code 3" in rec["detail"]
    # rank 1 printed its scratch before exiting (rank 0 may be stopped before it prints)
    out = job.output()
    assert "is not a private directory" not in out
    assert f"LOCAL_DIR {local}/gpuguard-{job.id} mode 0o700" in out, out[-3000:]
    job.wait_for(lambda: not (local / f"gpuguard-{job.id}").exists(), "the epilog to remove the scratch", 30)
    assert any("job scratch: removed" in line for line in site.log_lines(f"job {job.id}"))


@pytest.mark.slow(12)
def test_syntax_error_is_not_retried(site_factory, tmp_path):
    site = site_factory(nodes=2)
    broken = site.cluster.jobs_dir / "broken_train.py"
    broken.write_text("import torch\ndef main(:\n    pass\n")
    job = Job(site, command=[str(broken)], max_requeues=3)
    info = job.wait()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.why(info)
    ledger = job.ledger()
    assert [(r["reason"], r["action"]) for r in ledger] == [("no_retry", "gave_up")], ledger
    assert "SyntaxError" in ledger[0]["detail"]
