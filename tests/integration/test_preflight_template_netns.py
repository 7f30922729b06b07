"""The torchrun template's pre-flight end to end on namespaced nodes (preflightnet.py): on by default, a 2-node job
passes it and trains; with `min_nodes` a blamed node is left out and the training goes on in the same allocation."""

from __future__ import annotations

import re

import pytest
from preflightnet import BUDGET, template_site
from torchjob import NEEDS_HOST_VIEW, NEEDS_TORCH, netns_site

pytestmark = [NEEDS_HOST_VIEW, NEEDS_TORCH]


@pytest.mark.slow(75)
def test_a_two_node_template_job_runs_the_preflight_before_training(site_factory):
    """Issue 28: the torchrun template runs the pre-flight by default for 2+ nodes (a 2-node job), it passes, and
    the training starts after it."""
    from torchjob import Job

    site = netns_site(site_factory, nodes=2)
    job = Job(site, steps=4, step_time=0.2, max_failures=0, preflight="default", preflight_budget_s=BUDGET)
    info = job.wait(timeout=240)
    out = job.output()
    assert info["JobState"] == "COMPLETED", job.why(info)
    pre = re.search(r"^gpuguard preflight: 2 nodes node\[1-2\] in ([\d.]+)s: passed", out, re.M)
    assert pre and float(pre.group(1)) <= BUDGET, job.why(info)
    trained = re.search(r"\[rank\d\]: rank \d/2 on node", out)
    assert trained and pre.start() < trained.start(), job.why(info)  # before the training


@pytest.mark.slow(80)
def test_with_min_nodes_the_training_goes_on_without_the_blamed_node(site_factory):
    """Issue 28 item 3: a 3-node template job with min_nodes 2 and node3's link slowed: the pre-flight blames node3,
    and the training runs at once on node[1-2] in the same allocation (one attempt, no requeue)."""
    from torchjob import Job

    site = template_site(site_factory, 3)
    site.cluster.host_view.slow_link(3, "20mbit")
    job = Job(site, nodes=3, min_nodes=2, steps=4, step_time=0.2, max_failures=0, preflight="default",
              preflight_budget_s=BUDGET)
    info = job.wait(timeout=300)
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", job.why(info)
    assert re.search(r"gpuguard preflight: 3 nodes node\[1-3\] in [\d.]+s: blamed node3 \(", out), job.why(info)
    assert "the training goes on without it on 2 of 3 nodes (min_nodes 2)" in out, job.why(info)
    ranks = set(re.findall(r"\[rank\d\]: rank \d/(\d) on (node\d)", out))
    assert ranks == {("2", "node1"), ("2", "node2")}, job.why(info)
    ledger = job.ledger()
    assert [(r["reason"], r["action"]) for r in ledger] == [("completed", "finished")], ledger
    assert "the pre-flight blamed node3: this attempt trained without them" in ledger[0]["detail"], ledger
