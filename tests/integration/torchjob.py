"""Helpers of the torchrun end-to-end tests (test_torchrun*.py): a rendered torchrun job on a DevSite, with what it
leaves behind; a site laid out like stock Debian nodes and the checkpoint across a time limit that
test_torchrun_debian.py and test_torchrun_oldest.py both drive; the oldest supported PyTorch in a venv of its own."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from devtools.devcluster import free_tcp_ports
from devtools.devhost import DebianHostView, missing_host_view_requirements
from devtools.oldtorch import OLDEST_TORCH, oldest_torch_venv  # noqa: F401 - the helpers' face for the tests
from gpuguard.templates import render_template

TRAIN = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "tiny_train.py"
# the same command line and control files without torch, for the tests of the template's orchestration alone
STAND_IN = TRAIN.with_name("stand_in_train.py")

NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="CPU PyTorch not installed (make torch): torchrun e2e tests")
NEEDS_HOST_VIEW = pytest.mark.skipif(bool(missing_host_view_requirements()) or os.geteuid() != 0,
                                     reason="a Debian-like host view needs root, unshare, nsenter and ip: "
                                            + "; ".join(missing_host_view_requirements()))

VENV_BIN = Path(sys.executable).parent


def newest_torchrun() -> str:
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

    def __init__(self, site, sbatch_args=(), train=TRAIN, **values):
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
            "nodes": 2, "gpus_per_node": 0, "nproc_per_node": 1, "exclusive": False, "torchrun": newest_torchrun(),
            "command": [str(train), "--ckpt-dir", str(self.ckpt), "--steps", str(steps), "--step-time",
                        str(step_time), "--control", str(self.control)] + (["--save-delay", str(save_delay)]
                                                                          if save_delay else []),
            "checkpoint_dir": str(self.ckpt), "checkpoint_glob": "step-*", "checkpoint_marker": "COMPLETE",
            "gpuguard": str(wrapper), "gpuguard_config": str(site.config_path),
            "job_root": str(c.jobs_dir / "runs"), "output": str(c.jobs_dir / "train-%j.out"),
            "job_name": "tiny-train", "local_dir": str(site.workdir / "local"),
            # every dev cluster numbers its jobs from 1: the default port (29500 + job id) would collide between
            # clusters running at the same time on this one host
            "rdzv_port": free_tcp_ports(1)[0],
            # the pre-flight (on by default for 2+ nodes) adds seconds of torch imports to every job: only the tests
            # about it turn it on
            "preflight": False,
        }
        base.update(values)
        if base["preflight"] == "default":  # the template's own default (on)
            del base["preflight"]
        self.script = site.workdir / "job.sbatch"
        self.script.write_text(render_template("torchrun.sbatch.j2", base))
        out = c.run(["sbatch", "--parsable", f"--chdir={c.jobs_dir}", *sbatch_args, str(self.script)])
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
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            # every 0.2 s, every 0.5 s after 5 s: many predicates ask slurmctld (about 10 ms of CPU each)
            time.sleep(0.2 if time.monotonic() - start < 5 else 0.5)
        raise AssertionError(f"timed out waiting for {what}\n--- output ---\n{self.output()[-4000:]}\n"
                             f"--- ledger ---\n{self.ledger()}\n--- job ---\n{self.info()}")


def debian_site(site_factory, **kw):
    """A DevSite whose nodes look like stock Debian nodes (devtools.devhost.DebianHostView)."""
    return site_factory(host_view=DebianHostView(), **kw)


def checkpoint_across_the_time_limit(site, job, stop=("time_limit", "timelimit")):
    """The checkpoint asked 100 s before the time limit (USR1 up to 30 s earlier still: Slurm's timer runs every
    30 s), then rank 0 needs 45 s to write it; attempt 2 resumes and finishes. `stop`: the (reason, event) the
    ledger gives attempt 1: Slurm's warning near the limit is the time limit; a USR1 sent by hand long before it
    is ("manual_stop", "stop"). Returns (job info, output, ledger)."""
    (job.control / "finish-after-resume").touch()  # attempt 2 finishes soon after resuming
    job.wait_for(lambda: len(job.ledger()) >= 1, "attempt 1 to checkpoint and be requeued", timeout=240)
    # attempt 2 only has to resume and finish: give it room so that its own time-limit warning cannot come first
    assert job.site.cluster.run(["scontrol", "update", f"JobId={job.id}", "TimeLimit=20"]).returncode == 0
    info = job.wait(timeout=240)
    out = job.output()
    ledger = job.ledger()
    assert [(r["attempt"], r["reason"], r["action"], r["event"], r["budget"]) for r in ledger] == [
        (1, stop[0], "requeued", stop[1], "continuation"), (2, "completed", "finished", "none", None)], \
        job.why(info)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.why(info)
    saved = int(out.split("writing a slow checkpoint of step ")[1].split(" ")[0])
    assert (job.ckpt / f"step-{saved:06d}" / "COMPLETE").exists(), job.why(info)  # the 45 s checkpoint completed
    assert ledger[0]["ckpt_step"] == saved and ledger[1]["resumed_from"].endswith(f"step-{saved:06d}")
    assert f"resumed from step {saved}" in out and "SIGTERM: checkpointed step" in out
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90" in job.script.read_text()
    assert "SignalException" not in out  # a planned stop is not reported as torchrun's traceback
    assert [r["signal"] for r in job.store_attempts()] == [10, None]
    return info, out, ledger


def netns_site(site_factory, **kw):
    """A DevSite whose nodes are really apart (devtools.devnetns.NodeNetworks): each in its own network namespace
    with its own host name, on 127.0.1.1 in its own stock Debian /etc/hosts."""
    from devtools.devnetns import NodeNetworks

    return site_factory(host_view=NodeNetworks(), **kw)
