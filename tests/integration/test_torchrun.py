"""The torchrun template end to end on a real local Slurm cluster (gpuguard.devsite: munge, slurmctld, one
slurmd per node, gpuguard's prolog) with a real torchrun: CPU PyTorch, gloo, 2 nodes x 1 process, a tiny model
that checkpoints every step (tests/fixtures/templates/tiny_train.py). Faults are injected through files the
training reads, and through gpuguard's own health check draining a node with simulated Xid 79.

What a user would notice is asserted: the job's final state and restart count (scontrol show job), where each
attempt ran, the ledger in the job directory, the `attempts` table in the history store, and the training
output (resumed from which step)."""

from __future__ import annotations

import importlib.util
import json
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


class Job:
    """A rendered torchrun job submitted to a DevSite, with what it leaves behind."""

    def __init__(self, site, **values):
        self.site = site
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
        base = {
            "nodes": 2, "gpus_per_node": 0, "nproc_per_node": 1, "exclusive": False, "torchrun": _torchrun(),
            "command": [str(TRAIN), "--ckpt-dir", str(self.ckpt), "--steps", str(steps), "--step-time",
                        str(step_time), "--control", str(self.control)],
            "checkpoint_dir": str(self.ckpt), "checkpoint_glob": "step-*", "checkpoint_marker": "COMPLETE",
            "gpuguard": str(wrapper), "gpuguard_config": str(site.config_path),
            "job_root": str(c.jobs_dir / "runs"), "output": str(c.jobs_dir / "train-%j.out"),
            "job_name": "tiny-train",
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
        for db in sorted((self.site.workdir / "state").glob("*.db")):
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


def test_time_limit_checkpoints_requeues_and_the_maximum_is_respected(site_factory):
    site = site_factory(nodes=2)
    t0 = time.monotonic()
    # 1-minute limit, asked to checkpoint 59 s before it: Slurm's timer (every ~30 s) sends USR1 at its next pass.
    # The training never finishes in time, so both attempts hit the limit; max_requeues=1 allows one requeue.
    job = Job(site, steps=100000, step_time=0.3, time_limit="1", requeue_grace_s=59, max_requeues=1)
    info = job.wait(timeout=200)
    out = job.output()
    ledger = job.ledger()
    assert [(r["attempt"], r["reason"], r["action"], r["event"]) for r in ledger] == [
        (1, "time_limit", "requeued", "timelimit"), (2, "time_limit", "gave_up", "timelimit")], (ledger, out[-3000:])
    assert "maximum of 1 requeue(s) is reached" in ledger[1]["detail"]
    assert info["Restarts"] == "1" and info["JobState"] == "FAILED", job.why(info)  # gave up: no third attempt
    # SIGTERM went through torchrun to the worker, which checkpointed before exiting, in both attempts
    assert out.count("SIGTERM: checkpointed step") >= 2, out[-3000:]
    first = int(ledger[1]["resumed_from"].rsplit("-", 1)[1])
    assert f"resumed from step {first}" in out and first > 0
    assert [r["signal"] for r in job.store_attempts()] == [10, 10]  # SIGUSR1: --signal=B:USR1@59
    print(f"time limit x2 with max_requeues=1: {time.monotonic() - t0:.1f}s")


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
    # The node is repaired and back before attempt 2 starts: the job still stays off it
    site.set_scenario("node2", "healthy-p5")
    (job.control / "fault-node2").unlink()
    site.cluster.resume("node2")
    info = job.wait()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.why(info)
    assert info["NodeList"] == "node[1,3]", job.why(info)
    ledger = job.ledger()
    assert (ledger[1]["reason"], ledger[1]["nodes"]) == ("completed", "node[1,3]")
    assert ledger[1]["resumed_from"] and "resumed from step" in job.output()
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
