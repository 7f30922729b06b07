"""The job pre-flight's pure parts (gpuguard.preflight): judging a worker's output, blame inside the allocation
(a node, a switch, nothing reproducible) with a scripted fabric as `measure`, and Slurm's topology."""

from __future__ import annotations

from gpuguard.nccl.isolate import Measurement
from gpuguard.preflight.blame import run_blame
from gpuguard.preflight.judge import Step, measurement, parse_result, result_line, round_measurements, summary_line
from gpuguard.preflight.record import preflight_condition
from gpuguard.preflight.topology import blamed_switch, job_switches, parse_topology

NODES = ["node1", "node2", "node3", "node4"]
FLOOR = 1.0


ALLOWANCE = 15.0


def fabric(slow=(), hung=(), slow_links=(), blip_once=False, stopped=(), slow_s=2.0, cut_by_budget=False):
    """A measure(groups, stage) through the runner's own judging of a round (round_measurements): a group runs at
    2 GB/s in 2 s unless it holds a slow node (0.2 GB/s, in `slow_s`), a hung one (stopped at the allowance), or
    crosses a slow link (a pair of node sets); `stopped`: the (stage, group) steps the machine's load stopped at the
    allowance; `blip_once`: the first all-node run is slow, nothing after."""
    state = {"blipped": False}

    def step(g, stage):
        if stage == "all" and blip_once and not state["blipped"]:
            state["blipped"] = True
            return Step(g, result_line([4096], [0.1], "gloo", 4), 0, False, 1.0)
        if set(g) & set(hung) or (stage, frozenset(g)) in {(st, frozenset(x)) for st, x in stopped}:
            return Step(g, "", None, True, ALLOWANCE)
        crosses = any(set(g) & a and set(g) & b for a, b in slow_links)
        bw = 0.2 if set(g) & set(slow) or crosses else 2.0
        return Step(g, "noise\n" + result_line([4096], [bw * 3, bw], "gloo", len(g)), 0, False,
                    slow_s if bw < 1 else 2.0)

    def measure(groups, stage):
        return round_measurements([step(g, stage) for g in groups], stage, lambda n: FLOOR, ALLOWANCE,
                                  cut_by_budget)
    return measure


def test_a_worker_result_is_read_and_a_hang_or_failure_is_evidence():
    assert parse_result("x\n" + result_line([1, 4], [0.5, 1.5], "gloo", 2))["busbw_gbps"] == [0.5, 1.5]
    assert parse_result("GPUGUARD-PREFLIGHT {not json") is None
    ok = measurement(("a", "b"), "all", threshold=1.0, output=result_line([4], [1.5], "gloo", 2), rc=0,
                     timed_out=False, duration_s=1)
    assert (ok.verdict, ok.busbw_gbps, ok.size_bytes) == ("ok", 1.5, 4)
    hung = measurement(("a", "b"), "all", threshold=None, output="", rc=None, timed_out=True, duration_s=6)
    assert hung.verdict == "slow" and "hung" in hung.error  # no floor: still judged
    failed = measurement(("a", "b"), "all", threshold=1.0, output="Gloo connectFullMesh failed\n", rc=1,
                         timed_out=False, duration_s=1)
    assert failed.verdict == "slow" and "connectFullMesh" in failed.error


def test_a_healthy_allocation_passes_with_one_collective():
    b = run_blame(NODES, fabric())
    assert b.blamed == [] and b.exclude == [] and len(b.outcome.measurements) == 1
    assert b.what.startswith("passed, busbw 2")


def test_one_slow_node_is_blamed_with_its_evidence():
    b = run_blame(NODES, fabric(slow=["node3"]))
    assert b.blamed == ["node3"] and b.exclude == ["node3"]
    reason = b.nodes_to_drain["node3"]
    assert reason.startswith("gpuguard: NCCL fabric.nccl: busbw 0.2 GB/s vs 2 with peers node") and \
        reason.endswith("[preflight]"), reason
    peers = reason.split(" with peers ")[1].split(" [")[0]
    assert set(peers.split(",")) <= set(NODES) and len(peers.split(",")) == 2, reason  # not "node 1,4"
    assert len(reason) <= 120


def test_a_hung_node_is_blamed_as_a_hang_when_a_run_beside_it_finished():
    b = run_blame(NODES, fabric(hung=["node2"]))
    assert b.blamed == ["node2"], b.outcome.to_dict()
    assert "hang or failure (hung: no result within 15.0s, a run beside it took 2.0s)" in b.nodes_to_drain["node2"]


def test_a_confirm_step_stopped_by_load_convicts_no_innocent_node():
    """The measured case: node3's link slowed, its confirm run finished slowly, the innocent node2+node4 confirm
    run (same round) was stopped at its time on the loaded cores: node3 is blamed, node4 is unknown, not drained."""
    b = run_blame(NODES, fabric(slow=["node3"], slow_s=12.0, stopped=[("confirm", ("node4", "node2"))]))
    assert b.blamed == ["node3"] and b.exclude == ["node3"], b.outcome.to_dict()
    v = b.outcome.verdicts["node4"]
    assert v.status == "unknown" and "no run beside it finished in half that time" in v.evidence, v
    # every step of the round stopped (node3's too): no evidence at all, nothing drained, the job goes on
    both = run_blame(NODES, fabric(hung=["node3"], stopped=[("confirm", ("node4", "node2"))]))
    assert both.blamed == [] and both.exclude == [] and "nothing drained" in both.what, both.outcome.to_dict()


def test_a_step_cut_short_by_the_budget_is_never_evidence():
    b = run_blame(NODES, fabric(hung=["node2"], cut_by_budget=True))
    assert b.blamed == [] and b.exclude == [] and b.outcome.conclusion == "inconclusive", b.outcome.to_dict()
    ms = round_measurements([Step(("a", "b"), "", None, True, 4.0),
                             Step(("c", "d"), result_line([4], [2.0], "gloo", 2), 0, False, 1.0)],
                            "confirm", lambda n: FLOOR, 4.0, True)
    assert ms[0].verdict == "error" and "budget ran out" in ms[0].error and ms[1].verdict == "ok"


def test_a_one_off_not_reproduced_drains_nothing():
    b = run_blame(NODES, fabric(blip_once=True))
    assert b.blamed == [] and b.exclude == [] and b.outcome.conclusion == "inconclusive"
    assert "nothing drained" in b.what


TOPO = """SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node[1-2] Switches=(null)
SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=node[3-4] Switches=(null)
SwitchName=leaf3 Level=0 LinkSpeed=1 Nodes=node[5-8] Switches=(null)
SwitchName=spine Level=1 LinkSpeed=1 Nodes=node[1-8] Switches=leaf[1-3]
garbage line
"""


def test_topology_is_read_and_limited_to_the_job():
    topo = parse_topology(TOPO)
    assert topo["leaf1"] == ["node1", "node2"] and topo["leaf3"] == ["node5", "node6", "node7", "node8"]
    mine = job_switches({k: v for k, v in topo.items() if k != "spine"}, NODES)
    assert mine == {"leaf1": ["node1", "node2"], "leaf2": ["node3", "node4"]}


def test_the_nodes_of_one_switch_slow_together_blame_the_switch_and_drain_no_node():
    switches = {"leaf1": ["node1", "node2"], "leaf2": ["node3", "node4"]}
    b = run_blame(NODES, fabric(slow=["node1", "node2"]), switches)
    assert b.switch == "leaf1" and b.nodes_to_drain == {} and b.exclude == ["node1", "node2"]
    # the same slow nodes without a topology: the nodes are blamed
    assert run_blame(NODES, fabric(slow=["node1", "node2"])).blamed == ["node1", "node2"]


def test_slow_pairs_exactly_those_crossing_one_switch_blame_it():
    switches = {"leaf1": ["node1", "node2"], "leaf2": ["node3", "node4"], "leaf3": ["node5", "node6"]}
    nodes = ["node1", "node3", "node2", "node5", "node4", "node6"]
    m = fabric(slow_links=[({"node1", "node2"}, {"node3", "node4", "node5", "node6"})])
    b = run_blame(nodes, m, switches)
    assert b.switch == "leaf1", b.outcome.to_dict()
    one_node = run_blame(NODES, fabric(slow=["node3"]), {"leaf1": ["node1", "node2"], "leaf2": ["node3", "node4"]})
    assert one_node.switch is None and one_node.blamed == ["node3"]


def test_blamed_switch_needs_a_fit():
    out = run_blame(NODES, fabric(slow=["node3"])).outcome
    assert blamed_switch(out, {"leaf1": NODES}) is None


def test_the_condition_stands_until_an_admin_clears_it():
    c = preflight_condition("gpuguard: NCCL fabric.nccl: busbw 0.2 GB/s vs 2 with peers node1 [preflight]",
                            "busbw 0.2", {"busbw_gbps": 0.2, "source": "preflight", "bad": True}, 100.0)
    assert (c.origin, c.check_id, c.keyword, c.action, c.standing) == ("preflight", "fabric.nccl", "NCCL", "drain",
                                                                        True)
    assert c.evidence == {"busbw_gbps": 0.2, "source": "preflight"}


def test_summary_line_says_what_how_long_and_who():
    line = summary_line(NODES, 6.24, "isolated", ["node3"], "busbw 0.2")
    assert line == "gpuguard preflight: 4 nodes node[1-4] in 6.2s: blamed node3 (busbw 0.2)"
    assert isinstance(Measurement(("a",), "all"), Measurement)


def test_a_blamed_switch_pages_the_network_team_once_with_the_switch_as_its_label(tmp_path, monkeypatch):
    """Issue 28: the pre-flight's switch blame is a page of its own (`gpuguard: NETWORK switch leaf7`), sent by
    the node that ran the pre-flight, labelled with the switch (as the storm guard's shared-part page): an
    Alertmanager route can send it to the network team; a second blame of the same switch is the same alert."""
    from notify_servers import WebhookServer
    from simnode import make_cfg

    from gpuguard.nccl.isolate import SweepOutcome
    from gpuguard.notify.alertmanager import alert_labels
    from gpuguard.notify.event import Event
    from gpuguard.notify.render import title_of
    from gpuguard.preflight.blame import Blame
    from gpuguard.preflight.cli import page_switch

    hook = WebhookServer()
    try:
        monkeypatch.setenv("SLURMD_NODENAME", "node1")
        monkeypatch.setenv("SLURM_JOB_ID", "42")
        cfg = make_cfg(tmp_path, notify={"urls": [hook.url("/pages")]})
        blame = Blame(SweepOutcome(["node1", "node2", "node3", "node4"]), switch="leaf7", exclude=["node3", "node4"])
        assert page_switch(cfg, blame) == "page: sent"
        bodies = [r["body"] for r in hook.requests]
        assert len(bodies) == 1 and bodies[0]["title"] == "gpuguard: NETWORK switch leaf7 fabric.nccl", bodies
        assert "its nodes node[3-4] slow together in a job pre-flight" in bodies[0]["message"]
        assert "look at the switch" in bodies[0]["message"]
    finally:
        hook.close()
    ev = Event(kind="network", node="node1", message="m", severity="critical", check_id="fabric.nccl",
               component="leaf7", component_kind="switch")
    labels = alert_labels(ev, cfg.notify)
    assert (labels["alertname"], labels["switch"], labels["component"], labels["component_kind"]) == \
        ("GpuguardNetworkFault", "leaf7", "leaf7", "switch")
    assert title_of(ev) == "gpuguard: NETWORK switch leaf7 fabric.nccl"
