"""The torchrun template end to end on a real local Slurm cluster (gpuguard.devsite: munge, slurmctld, one
slurmd per node, gpuguard's prolog) with a real torchrun: CPU PyTorch, gloo, 2 nodes x 1 process, a tiny model
that checkpoints every step (tests/fixtures/templates/tiny_train.py). Faults are injected through files the
training reads, and through gpuguard's own health check draining a node with simulated Xid 79.

What a user would notice is asserted: the job's final state and restart count (scontrol show job), where each
attempt ran, the ledger in the job directory, the `attempts` table in the user-side store (templates.store_path,
never the hooks' store), the training output (resumed from which step) and the node-local scratch directory."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from gpuguard.devcluster import free_tcp_ports
from gpuguard.templates import render_template

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="CPU PyTorch not installed (pip install torch==2.13.0): torchrun e2e tests")

TRAIN = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "tiny_train.py"
VENV_BIN = Path(sys.executable).parent


def _torchrun() -> str:
    cand = VENV_BIN / "torchrun"
    return str(cand) if cand.exists() else "torchrun"


def configure(site, **extra):
    """The site as these tests run it: job attempts go to a user-side store of their own (issue 9: never the
    hooks' store), node-local scratch under the site's own directory (like /tmp: sticky, world-writable)."""
    local = site.workdir / "local"
    local.mkdir(exist_ok=True)
    local.chmod(0o1777)
    cfg = {"templates": {"store_path": str(site.workdir / "user-state" / "attempts-{user}.db")},
           "epilog": {"scratch_dirs": [str(local)]}}
    cfg.update(extra)
    site.write_config(cfg)
    return local


class Job:
    """A rendered torchrun job submitted to a DevSite, with what it leaves behind."""

    def __init__(self, site, **values):
        self.site = site
        if "templates" not in site.config:
            configure(site)
        c = site.cluster
        self.ckpt = c.jobs_dir / "ckpt"
        self.control = c.jobs_dir / "control"
        self.control.mkdir(exist_ok=True)
        # the real CLI, as `python -m gpuguard` (a DevSite has no installed bin/gpuguard)
        wrapper = site.workdir / "gpuguard"
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m gpuguard \"$@\"\n")
        wrapper.chmod(0o755)
        steps = values.pop("steps", 6)
        step_time = values.pop("step_time", 0.2)
        save_delay = values.pop("save_delay", 0)
        base = {
            "nodes": 2, "gpus_per_node": 0, "nproc_per_node": 1, "exclusive": False, "torchrun": _torchrun(),
            "command": [str(TRAIN), "--ckpt-dir", str(self.ckpt), "--steps", str(steps), "--step-time",
                        str(step_time), "--control", str(self.control)] + (["--save-delay", str(save_delay)]
                                                                          if save_delay else []),
            "checkpoint_dir": str(self.ckpt), "checkpoint_glob": "step-*", "checkpoint_marker": "COMPLETE",
            "gpuguard": str(wrapper), "gpuguard_config": str(site.config_path),
            "job_root": str(c.jobs_dir / "runs"), "output": str(c.jobs_dir / "train-%j.out"),
            "job_name": "tiny-train", "local_dir": str(site.workdir / "local"),
            # every dev cluster numbers its jobs from 1: the default port (29500 + job id) would collide between
            # clusters running at the same time on this one host
            "rdzv_port": free_tcp_ports(1)[0],
        }
        base.update(values)
        self.script = site.workdir / "job.sbatch"
        self.script.write_text(render_template("torchrun.sbatch.j2", base))
        out = c.run(["sbatch", "--parsable", f"--chdir={c.jobs_dir}", str(self.script)])
        assert out.returncode == 0, out.stderr
        self.id = out.stdout.strip().split(";")[0]

    def info(self):
        return self.site.cluster.job_info(self.id)

    def wait(self, timeout=150):
        return self.site.cluster.wait_job(self.id, timeout=timeout)

    def why(self, info=None) -> str:
        """What a person would look at when an assertion fails: job state, ledger, end of the output."""
        return f"job: {info or self.info()}\nledger: {self.ledger()}\noutput tail:\n{self.output()[-4000:]}"

    def output(self) -> str:
        p = self.site.cluster.jobs_dir / f"train-{self.id}.out"
        return p.read_text(errors="replace") if p.exists() else ""

    def ledger(self) -> list[dict]:
        p = self.site.cluster.jobs_dir / "runs" / self.id / "attempts.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []

    def store_attempts(self) -> list[dict]:
        rows = []
        for db in sorted((self.site.workdir / "user-state").glob("*.db")):
            with sqlite3.connect(db) as conn:
                conn.row_factory = sqlite3.Row
                try:
                    rows += [dict(r) for r in conn.execute("SELECT * FROM attempts WHERE job_id=? ORDER BY attempt",
                                                          (self.id,))]
                except sqlite3.OperationalError:
                    pass
        return rows

    def wait_for(self, predicate, what, timeout=90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n--- output ---\n{self.output()[-4000:]}\n"
                             f"--- ledger ---\n{self.ledger()}\n--- job ---\n{self.info()}")


def test_failed_attempt_is_requeued_and_resumes_from_its_checkpoint(site_factory):
    site = site_factory(nodes=3)
    t0 = time.monotonic()
    job = Job(site, max_requeues=2)
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
    print(f"fail -> requeue -> resume -> finish: {time.monotonic() - t0:.1f}s")


def test_a_45s_checkpoint_fits_the_shutdown_window_and_time_limits_do_not_use_the_failure_budget(site_factory):
    """Issue 10 (critical): torchrun SIGKILLs its workers 30 s after forwarding SIGTERM unless told otherwise, so a
    45 s checkpoint started at the time-limit warning was lost. The template gives torchrun requeue_grace_s minus a
    margin (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90 here). With max_failures=0 the continuation is still requeued: time
    limits have their own budget. The planned stop leaves one clean line, not torchrun's traceback."""
    site = site_factory(nodes=2)
    t0 = time.monotonic()
    # 2-minute limit, checkpoint asked 100 s before it: USR1 at ~20-50 s (Slurm's 30 s timer), then rank 0 needs 45 s
    job = Job(site, steps=100000, step_time=0.3, time_limit="2", requeue_grace_s=100, max_failures=0,
              save_delay=45)
    (job.control / "finish-after-resume").touch()  # attempt 2 finishes soon after resuming
    job.wait_for(lambda: len(job.ledger()) >= 1, "attempt 1 to checkpoint and be requeued", timeout=200)
    # attempt 2 only has to resume and finish: give it room so that its own time-limit warning cannot come first
    assert site.cluster.run(["scontrol", "update", f"JobId={job.id}", "TimeLimit=10"]).returncode == 0
    info = job.wait(timeout=200)
    out = job.output()
    ledger = job.ledger()
    assert [(r["attempt"], r["reason"], r["action"], r["event"], r["budget"]) for r in ledger] == [
        (1, "time_limit", "requeued", "timelimit", "continuation"), (2, "completed", "finished", "none", None)], \
        job.why(info)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.why(info)
    saved = int(out.split("writing a slow checkpoint of step ")[1].split(" ")[0])
    assert (job.ckpt / f"step-{saved:06d}" / "COMPLETE").exists()  # the 45 s checkpoint completed
    assert ledger[0]["ckpt_step"] == saved and ledger[1]["resumed_from"].endswith(f"step-{saved:06d}")
    assert f"resumed from step {saved}" in out and "SIGTERM: checkpointed step" in out
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90" in job.script.read_text()
    # a planned checkpoint-and-requeue: one line per node, no SignalException traceback
    assert "torchrun stopped its workers for a planned checkpoint-and-requeue (signal 15)" in out, out[-4000:]
    assert "SignalException" not in out
    # labelled output: srun's node label and torchrun's rank prefix
    assert "0: [rank0]: rank 0/2 on node1" in out and "1: [rank1]: rank 1/2 on node2" in out
    assert [r["signal"] for r in job.store_attempts()] == [10, None]
    print(f"45 s checkpoint, continuation, resume: {time.monotonic() - t0:.1f}s")


def test_a_worker_exit_code_in_the_no_retry_list_is_not_retried(site_factory):
    """Issue 10: torchrun exits 1 whatever its worker's code, so no_retry_exit_codes never matched. The worker's
    own code (3, from torchrun's root-cause report) is recorded and matched."""
    site = site_factory(nodes=2)
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


def test_private_scratch_per_node_and_the_epilog_removes_it(site_factory):
    """Issue 9: TRITON_CACHE_DIR under a predictable /tmp/gpuguard-<jobid> could be pre-created by another user.
    Each node creates it privately (0700, the job user's) or, when the name is taken, a fresh mktemp directory;
    gpuguard's epilog removes the job's directories and leaves the squatter's alone."""
    site = site_factory(nodes=2, epilog=True)
    local = configure(site)
    squatted = local / "gpuguard-1"  # this cluster's first job id
    squatted.mkdir()
    squatted.chmod(0o777)
    os.chown(squatted, 65534, 65534)
    (squatted / "planted.py").write_text("print('owned')\n")
    job = Job(site, steps=3)
    assert job.id == "1"
    info = job.wait()
    out = job.output()
    assert info["JobState"] == "COMPLETED", job.why(info)
    assert "is not a private directory" in out
    seen = [line.split("LOCAL_DIR ")[1].split() for line in out.splitlines() if "LOCAL_DIR " in line]
    assert len(seen) == 2, out[-3000:]  # one line per node
    for path, _mode_kw, mode, _uid_kw, uid, *_ in seen:
        assert Path(path).parent == local and Path(path).name.startswith("gpuguard-1.") and mode == "0o700"
        assert uid == str(os.getuid())
    # after the job the epilog removed them (the job ends COMPLETED only once its epilogs are done)
    job.wait_for(lambda: not any(Path(p[0]).exists() for p in seen), "the epilog to remove the scratch", 30)
    assert squatted.is_dir() and (squatted / "planted.py").exists()  # someone else's: left alone
    # an unsquatted job gets the predictable name, private, removed after the job
    job2 = Job(site, steps=3)
    info = job2.wait()
    out2 = job2.output()
    assert info["JobState"] == "COMPLETED" and "is not a private directory" not in out2, job2.why(info)
    assert f"LOCAL_DIR {local}/gpuguard-{job2.id} mode 0o700" in out2
    job2.wait_for(lambda: not (local / f"gpuguard-{job2.id}").exists(), "the epilog to remove the scratch", 30)
    assert any("job scratch: removed" in line for line in site.log_lines(f"job {job2.id}"))


def test_failed_node_is_excluded_on_requeue(site_factory):
    site = site_factory(nodes=3)
    job = Job(site, steps=12, step_time=0.5, max_requeues=2)
    job.wait_for(lambda: (job.ckpt / "step-000002" / "COMPLETE").exists(), "the first checkpoints")
    assert job.info()["NodeList"] == "node[1-2]"
    # GPU 3 of node2 falls off the bus: gpuguard's health check drains node2, the rank there dies
    site.set_scenario("node2", "xid79")
    hc = site.run_hook("healthcheck", "node2")
    assert "DRAIN" in site.cluster.node_flags("node2"), (hc.stdout, hc.stderr)
    assert site.cluster.node_info("node2")["Reason"].startswith("gpuguard: XID79 gpu.xid")
    (job.control / "fault-node2").touch()
    job.wait_for(lambda: len(job.ledger()) >= 1, "attempt 1 to be recorded")
    first = job.ledger()[0]
    assert (first["reason"], first["action"], first["excluded"]) == ("node_failure", "requeued", ["node2"]), first
    assert "gpuguard: XID79 gpu.xid" in first["detail"]
    job.wait_for(lambda: job.info().get("ExcNodeList") == "node2", "ExcNodeList=node2 on the requeued job")
    # The node is repaired and back before attempt 2 starts: the job still stays off it for this attempt
    site.set_scenario("node2", "healthy-p5")
    (job.control / "fault-node2").unlink()
    site.cluster.resume("node2")
    # attempt 2 fails too: at that requeue the exclusions are re-evaluated and node2, healthy again, is dropped
    (job.control / "fault-node3").touch()
    job.wait_for(lambda: len(job.ledger()) >= 2, "attempt 2 to be recorded")
    (job.control / "fault-node3").unlink()
    second = job.ledger()[1]
    assert (second["nodes"], second["reason"], second["action"]) == ("node[1,3]", "app_error", "requeued"), second
    assert second["unexcluded"] == ["node2"] and second["exclusions"] == [], second
    info = job.wait()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", job.why(info)
    assert info.get("ExcNodeList") in (None, "(null)", ""), job.why(info)
    ledger = job.ledger()
    assert ledger[2]["reason"] == "completed" and ledger[2]["resumed_from"] and "resumed from step" in job.output()
    rows = job.store_attempts()
    assert (rows[0]["reason"], rows[0]["excluded"]) == ("node_failure", "node2")


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


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def _torchrun_standalone(args, tmp_path, name):
    import subprocess

    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([_torchrun(), "--standalone", "--nproc-per-node=2", "--tee=3", str(EXAMPLE), *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}), \
        tmp_path / f"{name}.log"


def test_the_example_training_script_follows_the_contract(tmp_path):
    """examples/train.py: SIGTERM to every process (what scancel --signal=TERM does) stops all ranks at the same
    step with one complete checkpoint (marker last); a resume continues from it; a bad configuration exits with
    the code meant for no_retry_exit_codes, which gpuguard reads from torchrun's report."""
    import signal
    import subprocess

    from gpuguard.templates.attempts import parse_torchrun_failures
    from gpuguard.templates.checkpoint import find_checkpoint

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
    p = subprocess.run([_torchrun(), "--standalone", "--nproc-per-node=1", str(EXAMPLE), "--ckpt-dir", str(ckpt),
                        "--lr", "-1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and [w.exit_code for w in parse_torchrun_failures(p.stdout + p.stderr)] == [2]
