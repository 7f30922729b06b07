"""`gpuguard preflight` on nodes really apart (devtools.devnetns.NodeNetworks, tests/integration/preflightnet.py):
gloo over CPU between 4 nodes; a healthy allocation passes within its budget; one node's link slowed (tc tbf) or cut:
that node, and no other, is blamed and drained as a standing condition of the node; the nodes under one switch of
topology.conf slowed together: the switch is blamed, no node drained, one page."""

from __future__ import annotations

import json
import re

import pytest
from preflightnet import BUDGET, NCCL, pf_site, preflight_samples, run_preflight
from torchjob import NEEDS_HOST_VIEW, NEEDS_TORCH, netns_site

from gpuguard.nccl import history
from gpuguard.nccl.cli_common import history_path, profile_of
from gpuguard.siteconfig import load_config

pytestmark = [NEEDS_HOST_VIEW, NEEDS_TORCH]


@pytest.mark.slow(60)
def test_a_healthy_allocation_passes_within_budget_and_a_slowed_node_is_blamed_and_drained(site_factory):
    site = pf_site(site_factory)
    out, took = run_preflight(site)
    print(f"healthy: {took:.1f}s from sbatch: {out}")
    assert re.search(r"gpuguard preflight: 4 nodes node\[1-4\] in [\d.]+s: passed, busbw", out), out
    assert "preflight-rc=0" in out and took < BUDGET + 30, (out, took)
    # the floor's source on the job line, and the pass recorded as the nodes' own history (a `preflight` sample)
    assert "[floor 0.005 GB/s (config), sample recorded, workers up in" in out, out
    assert preflight_samples(site) == 1

    site.cluster.host_view.slow_link(3, "20mbit")
    out, took = run_preflight(site)
    print(f"node3 slowed: {took:.1f}s from sbatch: {out}")
    spent = float(re.search(r"in ([\d.]+)s: ", out).group(1))
    assert spent <= BUDGET, out  # blame and drain included
    assert re.search(r"blamed node3 \(NCCL fabric.nccl: busbw [\d.]+ GB/s vs [\d.]+ with peers", out), out
    assert "GPUGUARD_PREFLIGHT_EXCLUDE=node3" in out and "preflight-rc=10" in out, out
    node = site.cluster.nodes_info()["node3"]
    assert "DRAIN" in node["State"] and node["Reason"].startswith("gpuguard: NCCL fabric.nccl: busbw"), node
    journal = json.loads((site.workdir / "run" / "node3.journal.json").read_text())
    others = [n for n in ("node1", "node2", "node4") if "DRAIN" in site.cluster.nodes_info()[n]["State"]]
    assert others == [], out
    assert any(c["origin"] == "preflight" and c["check_id"] == "fabric.nccl"
                                  for c in journal.get("conditions", [])), journal
    assert preflight_samples(site) == 1  # a pre-flight that blamed a node adds nothing


@pytest.mark.slow(40)
def test_without_a_configured_floor_the_nodes_own_history_gives_one(site_factory):
    """No `nccl.preflight_busbw_*`: five passed pre-flights' samples in the history give the floor (the job line
    says so) and node3's slowed link is blamed against it; without them the same run would only judge a hang."""
    site = pf_site(site_factory, floor=False)
    cfg = load_config(str(site.config_path))
    with history.open_history(history_path(cfg)) as st:
        history.record_samples(st, [(profile_of(cfg, None), 4, NCCL["preflight_max_bytes"], v, "node[1-4]",
                                     "preflight", str(i), "gloo") for i, v in enumerate((0.0052, 0.0053, 0.0054,
                                                                                         0.0052, 0.0053))])
        # the same figures from another collective: never this gloo pre-flight's floor
        history.record_samples(st, [(profile_of(cfg, None), 4, NCCL["preflight_max_bytes"], 0.5, "node[1-4]",
                                     "preflight", str(i), "nccl-tests") for i in range(5)])
    site.cluster.host_view.slow_link(3, "20mbit")
    out, _ = run_preflight(site)
    print(f"node3 slowed, floor from the history: {out}")
    assert re.search(r"\[floor 0.00\d+ GB/s \(baseline 5 gloo samples\), workers up in", out), out
    assert re.search(r"blamed node3 \(NCCL fabric.nccl: busbw [\d.]+ GB/s vs [\d.]+ with peers", out), out
    assert "GPUGUARD_PREFLIGHT_EXCLUDE=node3" in out and preflight_samples(site) == 5, out


@pytest.mark.slow(40)
def test_a_node_cut_off_is_blamed_within_budget_and_the_others_are_not(site_factory):
    """node3's cable pulled: its steps cannot even start (srun fails to reach its slurmd). The pre-flight names it
    within its budget, never hangs the job start, and drains it from the batch node (it cannot run the record
    step itself); no other node is blamed. --no-kill: Slurm must not end the job itself when it marks node3 down."""
    site = pf_site(site_factory)
    site.cluster.host_view.cut_link(3)
    out, took = run_preflight(site, "--no-kill")
    print(f"node3 cut: {took:.1f}s from sbatch: {out}")
    assert re.search(r"blamed node3 \(NCCL fabric.nccl: hang or failure", out), out
    assert float(re.search(r"in ([\d.]+)s: ", out).group(1)) <= BUDGET, out
    assert "GPUGUARD_PREFLIGHT_EXCLUDE=node3\n" in out and "preflight-rc=10" in out, out
    info = site.cluster.nodes_info()
    assert info["node3"]["Reason"].startswith("gpuguard: NCCL fabric.nccl: hang or failure"), info["node3"]
    assert [n for n in ("node1", "node2", "node4") if "DRAIN" in info[n]["State"]] == [], out


@pytest.mark.slow(45)
def test_the_nodes_under_one_switch_slowed_together_blame_the_switch(site_factory):
    """Issue 28: topology.conf puts node[1-2] under leafA and node[3-4] under leafB; both of leafB's links slowed.
    The pre-flight blames the switch, not its nodes: no node drained, one page (`gpuguard: NETWORK switch leafB`)
    to the site's receiver, leafB's nodes excluded from this job only."""
    from notify_servers import WebhookServer

    hook = WebhookServer(host="0.0.0.0")  # the batch node dials the bridge's address, not this machine's loopback
    try:
        site = netns_site(site_factory, nodes=4, topology={"leafA": "node[1-2]", "leafB": "node[3-4]"})
        view = site.cluster.host_view
        site.write_config({"nccl": NCCL,
                           "notify": {"urls": [hook.url("/pages", view.controller_addr)]}})
        view.slow_link(3, "20mbit")
        view.slow_link(4, "20mbit")
        out, took = run_preflight(site)
        print(f"leafB slowed: {took:.1f}s from sbatch: {out}")
        assert re.search(r"in [\d.]+s: blamed leafB \(switch leafB: its nodes slow together, no node drained\).*; "
                         r"page: sent", out), out
        assert "GPUGUARD_PREFLIGHT_EXCLUDE=node[3-4]\n" in out and "preflight-rc=10" in out, out
        info = site.cluster.nodes_info()
        assert [n for n in info if "DRAIN" in info[n]["State"]] == [], out
        pages = [r for r in hook.requests if "NETWORK switch leafB" in json.dumps(r["body"])]
        assert len(pages) == 1, (hook.requests, out)
    finally:
        hook.close()
