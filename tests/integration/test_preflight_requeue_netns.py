"""The torchrun template's pre-flight blames a slowed node: the job is requeued without it and completes
(preflightnet.py)."""

from __future__ import annotations

import re

import pytest
from preflightnet import BUDGET, template_site
from torchjob import NEEDS_HOST_VIEW, NEEDS_TORCH

pytestmark = [NEEDS_HOST_VIEW, NEEDS_TORCH]


@pytest.mark.slow(100)
def test_a_slowed_node_is_blamed_and_the_job_requeued_without_it_completes(site_factory):
    """Issue 28: a 3-node template job on a 4-node cluster lands on node[1-3] with node3's link slowed: the
    pre-flight blames node3 and drains it, the attempt ends (event preflight, a failure of max_failures, the ledger
    says why), the job is requeued without node3, passes the pre-flight on node[1-2,4] and trains to completion."""
    from torchjob import Job

    site = template_site(site_factory, 4)
    site.cluster.host_view.slow_link(3, "20mbit")
    job = Job(site, nodes=3, steps=4, step_time=0.2, max_failures=2, preflight="default", preflight_budget_s=BUDGET)
    info = job.wait(timeout=360)
    out, ledger = job.output(), job.ledger()
    assert info["JobState"] == "COMPLETED", job.why(info)
    assert [(r["attempt"], r["reason"], r["event"]) for r in ledger][:1] == [(1, "preflight", "preflight")], \
        job.why(info)
    assert ledger[-1]["reason"] == "completed" and "node3" not in info["NodeList"], job.why(info)
    assert re.search(r"gpuguard preflight: 3 nodes node\[1-3\] in [\d.]+s: blamed node3 \(", out), job.why(info)
    assert re.search(r"gpuguard preflight: 3 nodes node\[1-2,4\] in [\d.]+s: passed", out), job.why(info)
    assert "DRAIN" in site.cluster.nodes_info()["node3"]["State"]
