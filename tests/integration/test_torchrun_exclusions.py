"""The torchrun template's node exclusions end to end on a real local Slurm cluster (see test_torchrun.py for the
setup and its torch-free stand-in worker, and for a node excluded on requeue and dropped again once healthy): a
job that needs every node of its partition is never excluded from it (issue 16). A file of its own so that
pytest-xdist can run it beside the other torchrun tests."""

from __future__ import annotations

import time

import pytest
from torchjob import NEEDS_TORCH, STAND_IN, Job

pytestmark = NEEDS_TORCH


@pytest.mark.slow(35)  # two attempts
def test_a_job_that_needs_every_node_is_not_excluded_from_its_own_partition(site_factory):
    """Issue 16: a 2-node job on a 2-node partition loses node2 (gpuguard's health check drains it). Excluding node2
    left the job pending forever (BadConstraints), even after node2 was repaired. Now node2 is not excluded (it is
    drained: Slurm does not use it meanwhile), and the job starts by itself once node2 is resumed."""
    site = site_factory(nodes=2)
    job = Job(site, train=STAND_IN, steps=12, step_time=0.5, max_failures=2)
    job.wait_for(lambda: (job.ckpt / "step-000002" / "COMPLETE").exists(), "the first checkpoints")
    site.set_scenario("node2", "xid79")
    hc = site.run_hook("healthcheck", "node2")
    assert "DRAIN" in site.cluster.node_flags("node2"), (hc.stdout, hc.stderr)
    (job.control / "fault-node2").touch()
    job.wait_for(lambda: len(job.ledger()) >= 1, "attempt 1 to be recorded")
    first = job.ledger()[0]
    assert (first["reason"], first["action"], first["exclusions"], first["unexcluded"]) == \
        ("node_failure", "requeued", [], ["node2"]), first
    assert "too few nodes" in first["exclusion_note"]
    assert "gpuguard: not excluding node2" in job.output()
    # pending, waiting for node2 (not BadConstraints), with no exclusion to drop by hand
    job.wait_for(lambda: job.info().get("JobState") == "PENDING", "the requeued job to pend")
    time.sleep(3)
    info = job.info()
    assert info["JobState"] == "PENDING" and info.get("ExcNodeList") in (None, "(null)", ""), job.why(info)
    # node2 is repaired (rebooted: the new boot id clears the fallen-off-the-bus condition) and resumed: nobody
    # touches the job
    site.write_scenario("node2", "healthy-p5", boot_id="00000000-0000-4000-8000-0000000b0072")
    (job.control / "fault-node2").unlink()
    site.cluster.resume("node2")
    info = job.wait(timeout=200)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1" and info["NodeList"] == "node[1-2]", \
        job.why(info)
    assert [r["reason"] for r in job.ledger()] == ["node_failure", "completed"]
