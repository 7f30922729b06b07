"""The drain-storm guard on a real Slurm cluster with a topology (topology.conf, TopologyPlugin=topology/tree):
the nodes under one leaf switch losing their EFA links together are one switch fault (issue 28 item 4)."""

from __future__ import annotations

import json
import time

import pytest
from nodeview import drained

from test_own_faults import _health_check_round, storm_pages
from test_own_faults import hook as run_hook


@pytest.mark.slow(25)
def test_most_nodes_under_one_switch_failing_fabric_efa_page_the_switch_and_drain_none(site_factory, hook):
    """6 nodes, leaf7 = node[1-4], leaf8 = node[5-6]. Every EFA link of node1-node4 goes down at once: their health
    checks (one round, as slurmd runs them) hold all four (the partition rule alone would have drained two), one page
    names switch leaf7, each held node's Comment names it; leaf8's nodes pass. Then node5 (under leaf8, healthy)
    loses its links: its own fault, and the switch's held nodes take none of the partition's drains (limit 2 of the
    2 nodes left), so it drains (before: ranked after the 4 held, it was held too) and nothing pages a partition
    storm. `gpuguard status` says so. Once the links are back the next round lets go of every hold."""
    site = site_factory(nodes=6, topology={"leaf7": "node[1-4]", "leaf8": "node[5-6]"},
                        config={"notify": {"urls": [hook.url("/pages")]}, "logging": {"level": "info"}})
    for n in ("node1", "node2", "node3", "node4"):
        site.write_scenario(n, "healthy-p5", fabric={"efa": {"down": list(range(32))}})
    _health_check_round(site)
    assert [n for n in site.cluster.node_names if drained(site, n)] == []
    comments = {n: site.cluster.node_info(n).get("Comment", "") for n in site.cluster.node_names}
    assert all(comments[n].startswith("gpuguard-storm:held:fabric.efa@switch=leaf7:")
               for n in ("node1", "node2", "node3", "node4")), comments
    assert comments["node5"] in ("", "(null)") and comments["node6"] in ("", "(null)")
    site.write_scenario("node5", "healthy-p5", fabric={"efa": {"down": list(range(32))}})
    run_hook(site, "healthcheck", "node5")
    assert [n for n in site.cluster.node_names if drained(site, n)] == ["node5"]
    assert site.cluster.node_info("node5").get("Comment", "") in ("", "(null)")
    pages = storm_pages(hook)
    assert [p["title"] for p in pages] == ["gpuguard: drain storm held switch leaf7 fabric.efa"], pages
    assert "switch leaf7: fabric.efa fails on 4 of the 4 nodes under it" in pages[0]["message"]
    out = site.gpuguard("status").stdout
    assert "held by the drain-storm guard (failing, not drained): 4 node(s)" in out, out
    assert "node[1-4]" in out and "one switch fault: switch leaf7" in out, out
    assert "1 node(s) drained by gpuguard" in out and "(switch leaf8)" in out, out  # node5, and where it hangs
    doc = json.loads(site.gpuguard("status", "--json").stdout)
    assert sorted(h["node"] for h in doc["held"]) == ["node1", "node2", "node3", "node4"]
    assert {h["component"] for h in doc["held"]} == {"switch=leaf7"}
    for n in ("node1", "node2", "node3", "node4"):
        site.set_scenario(n, "healthy-p5")
    _health_check_round(site)
    time.sleep(0.5)
    assert all(site.cluster.node_info(n).get("Comment", "") in ("", "(null)") for n in site.cluster.node_names)
    assert len(storm_pages(hook, timeout=1.0)) == 1
