"""The drain-storm guard: a check failing on every node at once pages a human instead of draining a fleet, decided
before anything is drained (gpuguard.pipeline.storm: the decision, pure; gpuguard.pipeline.stormguard: the marks in
Slurm, the census, the held node's memory). The same on a real cluster: tests/integration/test_own_faults.py."""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime
from types import SimpleNamespace
from typing import Optional

import pytest

from gpuguard.pipeline.storm import StormSettings, decide, format_mark, may_mark, parse_mark
from gpuguard.pipeline.stormguard import StormGuard, state_path
from gpuguard.slurm.client import NodeState, SlurmError, find_sinfo
from gpuguard.slurm.parse import NodeRow, parse_sinfo_census, parse_sinfo_census_fields
from gpuguard.slurm.reason import format_reason

from simnode import make_cfg

S = StormSettings(share=0.1, window_s=3600, min_nodes=2)
NOW = time.time()
EFA = format_reason("fabric.efa", "EFA", "28 EFA devices, 32 expected", "healthcheck")


def stamp(ago: float) -> str:
    return datetime.fromtimestamp(NOW - ago).strftime("%Y-%m-%dT%H:%M:%S")


def rows(n: int, drained: dict[str, tuple[str, float]], partition: str = "gpu",
         marks: Optional[dict[str, str]] = None) -> list[NodeRow]:
    out = []
    for i in range(1, n + 1):
        name = f"n{i:03d}"
        comment = (marks or {}).get(name, "")
        if name in drained:
            check, ago = drained[name]
            reason = format_reason(check, "EFA", "28 EFA devices, 32 expected", "healthcheck")
            out.append(NodeRow(name, partition, "drained", reason, stamp(ago), comment))
        else:
            out.append(NodeRow(name, partition, "idle", None, None, comment))
    return out


# --------------------------------------------------------------------------- the census


def test_parses_sinfo_with_pipes_in_a_foreign_reason():
    text = ("n001|gpu*|drained|2026-11-25T10:00:00|gpuguard: EFA fabric.efa: 28 EFA devices [healthcheck]\n"
            "n001|debug|drained|2026-11-25T10:00:00|gpuguard: EFA fabric.efa: 28 EFA devices [healthcheck]\n"
            "n002|gpu*|idle|Unknown|none\n"
            "n003|gpu*|drained*|2026-11-25T09:00:00|admin: cable|swap | ticket 7\n")
    r = parse_sinfo_census(text)
    assert [(x.node, x.partition, x.drained) for x in r] == [("n001", "gpu", True), ("n001", "debug", True),
                                                             ("n002", "gpu", False), ("n003", "gpu", True)]
    assert r[2].reason is None and r[2].reason_time is None and r[2].comment is None
    assert r[3].reason == "admin: cable|swap | ticket 7"


def test_parses_the_census_with_comments():
    """`sinfo -h -N -O ...` as Slurm 22.05 printed it here (fields ended by the unit separator)."""
    text = ("node1\x1fgpu*\x1fdrained\x1f2026-12-02T10:50:20\x1f(null)\x1fadmin: a | b with spaces\n"
            "node2\x1fgpu*\x1fidle\x1fUnknown\x1fgpuguard-storm:intent:fabric.efa:1733140000.52\x1fnone\n"
            "node3\x1fgpu*\x1fidle\x1fUnknown\x1f''\x1fnone\n")
    r = parse_sinfo_census_fields(text)
    assert [(x.node, x.state, x.reason, x.comment) for x in r] == [
        ("node1", "drained", "admin: a | b with spaces", ""),
        ("node2", "idle", None, "gpuguard-storm:intent:fabric.efa:1733140000.52"), ("node3", "idle", None, "")]
    assert parse_mark(r[1].comment).check_id == "fabric.efa" and parse_mark(r[1].comment).ts == 1733140000.52


def test_marks_never_take_an_admins_comment():
    assert may_mark("") and may_mark("(null)") and may_mark(format_mark("held", "sys.memory", NOW))
    assert not may_mark("rack 7, ticket 42") and not may_mark("gpuguard-undrain:1733140000:alice@login1")
    assert parse_mark("gpuguard-storm:bogus:x:1") is None and parse_mark("gpuguard-storm:held:x:soon") is None


# --------------------------------------------------------------------------- the decision


def test_the_first_drains_go_through_then_the_limit_holds():
    census = rows(64, {"n001": ("fabric.efa", 60), "n002": ("fabric.efa", 50)})
    assert decide(census, "n003", "fabric.efa", NOW, S).hold is None  # 2 of 64 < ceil(6.4) = 7
    census = rows(64, {f"n{i:03d}": ("fabric.efa", 60) for i in range(1, 8)})
    d = decide(census, "n010", "fabric.efa", NOW, S)
    assert d.hold and "7 of 64 nodes of partition gpu already drained" in d.hold and "limit 7" in d.hold
    assert d.page  # the first node held: nobody has told the storm yet


def test_other_checks_old_drains_and_flapping_do_not_count():
    census = rows(10, {"n001": ("gpu.temperature", 60), "n002": ("fabric.efa", 7200)})
    assert decide(census, "n003", "fabric.efa", NOW, S).hold is None
    assert decide(census, "n003", "gpu.temperature", NOW, S).hold is None  # 1 < min_nodes 2


def test_a_small_partition_still_takes_min_nodes_drains():
    assert decide(rows(3, {"n001": ("fabric.efa", 10)}), "n002", "fabric.efa", NOW, S).hold is None
    assert decide(rows(3, {"n001": ("fabric.efa", 10), "n002": ("fabric.efa", 5)}), "n003", "fabric.efa", NOW, S).hold


def test_a_simultaneous_round_ranks_the_same_for_everyone_and_pages_once():
    """Twenty nodes marked their intent in the same second, none drained yet: each computes the same order (time,
    then name); the first `limit` drain, the first held node pages the storm, naming who drains and who is held."""
    marks = {f"n{i:03d}": format_mark("intent", "fabric.efa", NOW - 2 + (i % 3) * 0.01) for i in range(1, 21)}
    census = rows(20, {}, marks=marks)
    decisions = {r.node: decide(census, r.node, "fabric.efa", NOW, S) for r in census}
    assert sorted(n for n, d in decisions.items() if d.hold is None) == ["n003", "n006"]  # limit 2: earliest marks
    paging = [n for n, d in decisions.items() if d.page]
    assert paging == ["n009"]  # the third earliest mark
    d = decisions["n009"]
    assert d.drained == ("n003", "n006") and len(d.held) == 18 and (d.partition, d.size, d.limit) == ("gpu", 20, 2)


def test_a_node_drained_counts_before_every_intent_and_a_late_node_does_not_page_again():
    marks = {"n004": format_mark("held", "fabric.efa", NOW - 30), "n005": format_mark("intent", "fabric.efa", NOW)}
    census = rows(20, {"n001": ("fabric.efa", 1), "n002": ("fabric.efa", 1)}, marks=marks)
    d = decide(census, "n005", "fabric.efa", NOW, S)
    assert d.hold and not d.page  # n004 was held (and told) before: the storm is known
    census = rows(20, {"n001": ("fabric.efa", 1), "n002": ("fabric.efa", 1)},
                  marks={"n005": format_mark("intent", "fabric.efa", NOW)})
    assert decide(census, "n005", "fabric.efa", NOW, S).page


def test_a_node_held_a_moment_earlier_in_the_same_round_ranks_where_its_intent_did():
    """Censuses are not taken in the order the marks were written: n004 (after the limit) decided first and is held
    already when n003 (first after the limit) takes its census. n003 still pages, n004 did not: one page."""
    marks = {"n001": format_mark("intent", "fabric.efa", NOW), "n002": format_mark("intent", "fabric.efa", NOW + 0.1),
             "n003": format_mark("intent", "fabric.efa", NOW + 0.2), "n004": format_mark("held", "fabric.efa", NOW + 0.3)}
    census = rows(20, {}, marks=marks)
    assert [decide(census, n, "fabric.efa", NOW, S).page for n in ("n001", "n002", "n003")] == [False, False, True]
    assert decide(census, "n001", "fabric.efa", NOW, S).hold is None
    marks["n003"] = format_mark("held", "fabric.efa", NOW + 0.2)
    marks["n004"] = format_mark("intent", "fabric.efa", NOW + 0.3)
    d = decide(rows(20, {}, marks=marks), "n004", "fabric.efa", NOW, S)
    assert d.hold and not d.page and d.held == ("n003", "n004")


def test_an_intent_left_by_a_dead_hook_expires_and_a_node_without_a_mark_comes_last():
    stale = {f"n{i:03d}": format_mark("intent", "fabric.efa", NOW - 600) for i in (1, 2)}
    assert decide(rows(20, {}, marks=stale), "n005", "fabric.efa", NOW, S).hold is None
    fresh = {f"n{i:03d}": format_mark("intent", "fabric.efa", NOW + 1) for i in (1, 2)}  # they marked after it
    assert decide(rows(20, {}, marks=fresh), "n005", "fabric.efa", NOW, S).hold  # no mark of its own: last


def test_a_node_in_two_partitions_is_held_by_the_stricter():
    census = rows(64, {}) + rows(4, {"n001": ("fabric.efa", 5), "n002": ("fabric.efa", 5)}, partition="small")
    assert decide(census, "n003", "fabric.efa", NOW, S).hold
    assert decide(census, "n010", "fabric.efa", NOW, S).hold is None  # only in the big one


# --------------------------------------------------------------------------- the guard's I/O


class Cluster:
    """slurmctld's view of one partition, shared by every node's guard: Comments, drains and censuses."""

    def __init__(self, n: int, comments: Optional[dict[str, str]] = None) -> None:
        self.nodes = {f"n{i:02d}": {"comment": (comments or {}).get(f"n{i:02d}", ""), "reason": None, "when": None}
                      for i in range(1, n + 1)}
        self.lock = threading.Lock()
        self.censuses = 0
        self.broken: Optional[str] = None
        self.unreachable: Optional[str] = None

    def client(self) -> "Cluster":
        return self

    def get_node(self, name: str) -> NodeState:
        n = self.nodes[name]
        return NodeState(name=name, states=frozenset({"IDLE"} | ({"DRAIN"} if n["reason"] else set())),
                         reason=n["reason"], fields={"Comment": n["comment"]})

    def set_comment(self, name: str, comment: str) -> None:
        with self.lock:
            self.nodes[name]["comment"] = comment

    def drain(self, name: str, reason: str) -> None:
        with self.lock:
            self.nodes[name].update(reason=reason, when=stamp(0))

    def census(self) -> list[NodeRow]:
        if self.broken:
            raise SlurmError(self.broken)
        with self.lock:
            self.censuses += 1
            return [NodeRow(name, "gpu", "drained" if n["reason"] else "idle", n["reason"], n["when"], n["comment"])
                    for name, n in self.nodes.items()]


def verdict(check: str = "fabric.efa") -> SimpleNamespace:
    return SimpleNamespace(primary=SimpleNamespace(check_id=check), reason=EFA)


def guard(tmp_path, cluster: Cluster, node: str, settle: float = 0.3) -> StormGuard:
    cfg = make_cfg(tmp_path, notify={"urls": ["json://127.0.0.1:1/x"]})
    return StormGuard(cfg, cluster, node, time.time, lambda: settle)


def round_of(tmp_path, cluster: Cluster) -> dict[str, tuple[StormGuard, object]]:
    """Every node's guard deciding at the same moment, as one health-check round does."""
    out: dict[str, tuple[StormGuard, object]] = {}

    def one(node: str) -> None:
        g = guard(tmp_path, cluster, node)
        out[node] = (g, g.decide(verdict()))

    threads = [threading.Thread(target=one, args=(n,)) for n in cluster.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_round_decides_before_draining_holds_all_but_the_limit_and_pages_once(tmp_path):
    cluster = Cluster(10)
    decided = round_of(tmp_path, cluster)
    going = sorted(n for n, (_, hold) in decided.items() if hold is None)
    held = {n: hold for n, (_, hold) in decided.items() if hold is not None}
    assert len(going) == 2 and len(held) == 8 and cluster.censuses == 10
    assert all(cluster.nodes[n]["reason"] is None for n in cluster.nodes)  # nothing was drained to decide
    pages = [e for h in held.values() for e in h.events]
    assert len(pages) == 1 and pages[0].kind == "storm" and pages[0].dedup_key == "gpuguard/storm/gpu/fabric.efa"
    from gpuguard.slurm.hostlist import compress_hostlist

    assert f"Drained (the first 2): {compress_hostlist(going)}." in pages[0].message
    assert f"Held, not drained: {compress_hostlist(sorted(held))}." in pages[0].message
    assert all(parse_mark(cluster.nodes[n]["comment"]).state == "held" for n in held)
    for n in going:  # the two drain; their intent marks go once the drain is in
        cluster.drain(n, EFA)
        decided[n][0].after_drain()
        assert cluster.nodes[n]["comment"] == ""


def test_a_held_node_takes_no_census_and_sends_no_page_for_the_rest_of_the_window(tmp_path):
    cluster = Cluster(10)
    decided = round_of(tmp_path, cluster)
    held = sorted(n for n, (_, hold) in decided.items() if hold is not None)
    before = cluster.censuses
    for n in held:
        again = guard(tmp_path, cluster, n).decide(verdict())
        assert again is not None and again.events == [] and "no new census" in again.why
    assert cluster.censuses == before
    # the check passes again on one of them: its mark leaves Slurm, its decision is forgotten
    g = guard(tmp_path, cluster, held[0])
    g.release(set())
    assert cluster.nodes[held[0]]["comment"] == "" and not os.path.exists(state_path(g.cfg, held[0]))
    guard(tmp_path, cluster, held[1]).release({"fabric.efa"})  # still failing: still held
    assert parse_mark(cluster.nodes[held[1]]["comment"]).state == "held"


def test_no_census_holds_and_pages_every_time_and_keeps_nothing(tmp_path):
    cluster = Cluster(3)
    cluster.broken = "cannot run sinfo: sinfo not found"
    for _ in range(2):
        g = guard(tmp_path, cluster, "n01", settle=0)
        hold = g.decide(verdict())
        assert hold is not None and "no census of the partitions could be taken" in hold.why
        assert "sinfo not found" in hold.why and [e.kind for e in hold.events] == ["storm"]
        assert cluster.nodes["n01"]["comment"] == "" and not os.path.exists(state_path(g.cfg, "n01"))
    cluster.broken = None
    assert guard(tmp_path, cluster, "n01", settle=0).decide(verdict()) is None  # sinfo works again: it drains


def test_an_admins_comment_is_never_overwritten(tmp_path):
    cluster = Cluster(3, comments={"n01": "rack 7, ticket 42"})
    assert guard(tmp_path, cluster, "n01", settle=0).decide(verdict()) is None  # decided without a mark of its own
    assert cluster.nodes["n01"]["comment"] == "rack 7, ticket 42"


# --------------------------------------------------------------------------- where sinfo is


def test_sinfo_is_found_like_scontrol(tmp_path):
    bin_dir = tmp_path / "opt" / "slurm" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("scontrol", "sinfo"):
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(0o755)
    wrapper = tmp_path / "wrap" / "scontrol"
    wrapper.parent.mkdir()
    wrapper.write_text("#!/bin/sh\nexec /opt/slurm/bin/scontrol \"$@\"\n")
    assert find_sinfo(str(bin_dir / "scontrol")) == str(bin_dir / "sinfo")
    assert find_sinfo(str(wrapper)) == "sinfo"  # no sinfo beside the wrapper: PATH, as for a bare "scontrol"
    assert find_sinfo("scontrol") == "sinfo"
    assert find_sinfo(str(wrapper), "/site/bin/sinfo") == "/site/bin/sinfo"  # slurm.sinfo


@pytest.mark.parametrize("where", ["beside", "key"])
def test_the_census_runs_the_sinfo_the_config_finds(tmp_path, where):
    from gpuguard.slurm.client import client_from_config

    stub = tmp_path / "bin" / "sinfo"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nprintf 'n1\\037gpu*\\037idle\\037Unknown\\037(null)\\037none\\n'\n")
    stub.chmod(0o755)
    scontrol = str(tmp_path / "bin" / "scontrol") if where == "beside" else "/nonexistent/wrapper/scontrol"
    cfg = make_cfg(tmp_path, slurm={"scontrol": scontrol, "backend": "cli",
                                    **({"sinfo": str(stub)} if where == "key" else {})})
    assert [r.node for r in client_from_config(cfg.slurm, 5.0).census()] == ["n1"]


# --------------------------------------------------------------------------- shared components (issue 28 item 4)

from gpuguard.notify.alertmanager import alert_labels  # noqa: E402
from gpuguard.notify.render import title_of  # noqa: E402
from gpuguard.slurm.components import Component, SWITCH_CHECKS  # noqa: E402

LEAF7 = Component("switch", "leaf7", tuple(f"n{i:03d}" for i in range(1, 17)), SWITCH_CHECKS)
LEAF8 = Component("switch", "leaf8", tuple(f"n{i:03d}" for i in range(17, 33)), SWITCH_CHECKS)


def test_most_nodes_under_one_switch_failing_a_fabric_check_is_the_switch_held_and_paged_once():
    """12 of the 16 nodes under leaf7 fail fabric.efa in one round: one switch fault. None of them drains (the
    partition rule alone would have drained the first 4 of 32), the first held pages once, naming the switch."""
    marks = {f"n{i:03d}": format_mark("intent", "fabric.efa", NOW - 2 + i * 0.01) for i in range(1, 13)}
    census = rows(32, {}, marks=marks)
    decisions = {n: decide(census, n, "fabric.efa", NOW, S, [LEAF8, LEAF7]) for n in marks}
    assert all(d.hold and d.component == LEAF7 for d in decisions.values())
    assert [n for n, d in decisions.items() if d.page] == ["n001"]
    assert "switch leaf7: 12 of the 16 nodes under it fail fabric.efa" in decisions["n005"].hold
    without = {n: decide(census, n, "fabric.efa", NOW, S) for n in marks}  # no topology: as before
    assert sorted(n for n, d in without.items() if d.hold is None) == ["n001", "n002", "n003", "n004"]


def test_a_switch_is_not_blamed_for_a_few_of_its_nodes_nor_for_a_check_it_does_not_explain():
    few = {f"n{i:03d}": format_mark("intent", "fabric.efa", NOW) for i in range(1, 9)}  # 8 of 16: not most
    d = decide(rows(32, {}, marks=few), "n008", "fabric.efa", NOW, S, [LEAF7])
    assert d.component is None and d.hold  # the partition rule holds it (limit 4), not the switch
    memory = {f"n{i:03d}": format_mark("intent", "sys.memory", NOW) for i in range(1, 13)}
    assert decide(rows(32, {}, marks=memory), "n001", "sys.memory", NOW, S, [LEAF7]).hold is None
    small = Component("switch", "leaf9", ("n001", "n002"), SWITCH_CHECKS)  # 2 of 2: as likely two bad nodes
    both = {n: format_mark("intent", "fabric.efa", NOW) for n in small.nodes}
    assert decide(rows(32, {}, marks=both), "n002", "fabric.efa", NOW, S, [small]).component is None


def test_nodes_drained_earlier_count_and_a_late_node_of_the_switch_is_held_without_another_page():
    drained = {f"n{i:03d}": ("fabric.efa", 600) for i in range(1, 8)}  # 7 drained one by one in 10 minutes
    census = rows(32, drained, marks={"n008": format_mark("held", "fabric.efa", NOW - 60, "switch=leaf7"),
                                      "n009": format_mark("intent", "fabric.efa", NOW)})
    d = decide(census, "n009", "fabric.efa", NOW, S, [LEAF7])
    assert d.hold and d.component == LEAF7 and not d.page and d.held == ("n008", "n009")
    assert d.drained == tuple(f"n{i:03d}" for i in range(1, 8))
    assert parse_mark(format_mark("held", "fabric.efa", NOW, "switch=leaf7")).component == "switch=leaf7"


def test_a_rack_from_the_site_file_holds_its_nodes_and_the_page_names_it(tmp_path):
    """The guard with a site file (no Slurm topology: scontrol fails): 6 nodes of rack12 fail gpu.temperature at
    once; all are held, one page, titled and labelled with the rack; each held mark names it."""
    site = tmp_path / "parts.yaml"
    site.write_text("rack:\n  checks: [gpu.temperature]\n  nodes:\n    rack12: n[01-06]\n")
    cluster = Cluster(10)
    cfg = make_cfg(tmp_path, notify={"urls": ["json://127.0.0.1:1/x"]},
                   slurm={"scontrol": "/bin/false", "shared_components_file": str(site)})
    decided: dict[str, object] = {}

    def one(node: str) -> None:
        decided[node] = StormGuard(cfg, cluster, node, time.time, lambda: 0.3).decide(verdict("gpu.temperature"))

    threads = [threading.Thread(target=one, args=(f"n{i:02d}",)) for i in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(h is not None for h in decided.values())
    pages = [e for h in decided.values() for e in h.events]
    assert len(pages) == 1 and pages[0].dedup_key == "gpuguard/rack/rack12/gpu.temperature"
    assert title_of(pages[0]) == "gpuguard: drain storm held rack rack12 gpu.temperature"
    labels = alert_labels(pages[0], cfg.notify)
    assert labels["component"] == "rack12" and labels["rack"] == "rack12" and labels["component_kind"] == "rack"
    assert "Held, not drained: n[01-06]" in pages[0].message
    assert all(cluster.nodes[n]["comment"].startswith("gpuguard-storm:held:gpu.temperature@rack=rack12:")
               for n in decided), {n: cluster.nodes[n]["comment"] for n in decided}
    assert all(parse_mark(cluster.nodes[n]["comment"]).component == "rack=rack12" for n in decided)


def test_a_broken_site_file_is_noted_and_the_partition_rule_still_guards(tmp_path):
    site = tmp_path / "parts.yaml"
    site.write_text("rack:\n  nodes:\n    rack12: n[01-\n")
    cluster = Cluster(10)
    cfg = make_cfg(tmp_path, slurm={"scontrol": "/bin/false", "shared_components_file": str(site)})
    g = StormGuard(cfg, cluster, "n01", time.time, lambda: 0)
    assert g.decide(verdict()) is None  # the first of the partition drains, as without the file
    assert g.notes == [f"slurm.shared_components_file {site}: line 3: rack.nodes.rack12: bad hostlist 'n[01-': "
                       "unbalanced brackets"]


# --------------------------------------------------------------------------- a component's fault and the partition


def test_a_switch_fault_takes_none_of_the_partitions_drains_from_a_node_elsewhere():
    """leaf7's 12 failing nodes are one switch fault, held and paged once. n020 (under leaf8, healthy) fails the same
    check in the same round: its own fault, and the partition's limit is computed without leaf7's nodes (16 of 32
    left: limit 2), so it drains. Without the fix leaf7's 12 intents ranked first and n020 came 13th of a limit of 4:
    held, and the partition storm paged as well."""
    marks = {f"n{i:03d}": format_mark("intent", "fabric.efa", NOW - 2 + i * 0.01) for i in range(1, 13)}
    marks["n020"] = format_mark("intent", "fabric.efa", NOW - 1)
    census = rows(32, {}, marks=marks)
    d = decide(census, "n020", "fabric.efa", NOW, S, [LEAF7, LEAF8])
    assert d.hold is None and not d.page, d.hold
    # the same once leaf7's nodes are held (their marks name the switch) and the round is over
    held = {n: format_mark("held", "fabric.efa", NOW - 2 + i * 0.01, "switch=leaf7") for i, n in
            enumerate(sorted(marks)[:12], start=1)}
    later = rows(32, {}, marks={**held, "n020": format_mark("intent", "fabric.efa", NOW)})
    assert decide(later, "n020", "fabric.efa", NOW, S, [LEAF7, LEAF8]).hold is None
    # a held mark names the switch even when leaf7 is no longer blamed from this census (some let go): still not
    # the partition's
    few = {n: m for n, m in held.items() if n in ("n001", "n002", "n003", "n004", "n005")}
    assert decide(rows(32, {}, marks={**few, "n020": format_mark("intent", "fabric.efa", NOW)}), "n020",
                  "fabric.efa", NOW, S, [LEAF7, LEAF8]).hold is None
    # and every leaf7 node still pages the switch once, not the partition
    decisions = {n: decide(census, n, "fabric.efa", NOW, S, [LEAF7, LEAF8]) for n in marks if n != "n020"}
    assert all(x.component == LEAF7 for x in decisions.values())
    assert [n for n, x in decisions.items() if x.page] == ["n001"]


def test_the_partition_limit_still_holds_unrelated_nodes_beyond_it():
    """The switch fault does not switch the partition rule off: outside leaf7 (16 nodes, limit 2), a third node
    failing in the same round is held and pages the partition's storm."""
    marks = {f"n{i:03d}": format_mark("intent", "fabric.efa", NOW - 2 + i * 0.01) for i in range(1, 13)}
    marks.update({n: format_mark("intent", "fabric.efa", NOW - 1 + k * 0.01)
                  for k, n in enumerate(("n020", "n021", "n022"))})
    census = rows(32, {}, marks=marks)
    out = {n: decide(census, n, "fabric.efa", NOW, S, [LEAF7, LEAF8]) for n in ("n020", "n021", "n022")}
    assert [out[n].hold is None for n in out] == [True, True, False]
    assert out["n022"].page and out["n022"].component is None and out["n022"].held == ("n022",)


def test_a_switch_whose_first_nodes_the_partition_rule_held_is_paged_once_when_it_is_blamed():
    """n001 was held by the partition rule (its mark names no component; it told the partition's storm then, and
    keeps its decision without another census). Now n002 and n003, also under leaf4, fail: 3 of 4, the switch is
    blamed. The switch page goes out once, from n002 (the first whose mark is, or will be, the switch's), not from
    n001 which decides nothing now; a later node of the switch does not page again."""
    leaf4 = Component("switch", "leaf4", ("n001", "n002", "n003", "n004"), SWITCH_CHECKS)
    drained = {"n010": ("fabric.efa", 300), "n011": ("fabric.efa", 300)}
    marks = {"n001": format_mark("held", "fabric.efa", NOW - 200),
             "n002": format_mark("intent", "fabric.efa", NOW), "n003": format_mark("intent", "fabric.efa", NOW + 0.1)}
    census = rows(20, drained, marks=marks)
    first = {n: decide(census, n, "fabric.efa", NOW, S, [leaf4]) for n in ("n002", "n003")}
    assert all(d.component == leaf4 and d.hold for d in first.values())
    assert [n for n, d in first.items() if d.page] == ["n002"]
    assert first["n002"].held == ("n001", "n002", "n003")
    # n003 takes its census after n002 marked itself held for the switch: the same, one page
    marks["n002"] = format_mark("held", "fabric.efa", NOW, "switch=leaf4")
    assert not decide(rows(20, drained, marks=marks), "n003", "fabric.efa", NOW, S, [leaf4]).page
    marks["n003"] = format_mark("held", "fabric.efa", NOW + 0.1, "switch=leaf4")
    marks["n004"] = format_mark("intent", "fabric.efa", NOW + 30)
    late = decide(rows(20, drained, marks=marks), "n004", "fabric.efa", NOW + 30, S, [leaf4])
    assert late.component == leaf4 and not late.page


# --------------------------------------------------------------------------- marks across versions (an upgrade)


def _parse_mark_before_components(comment: Optional[str]) -> Optional[tuple[str, str, float]]:
    """parse_mark as released before shared components (commit ae80d4d), verbatim but for the tuple: what a node
    not yet upgraded reads in every other node's Comment (its census) and in its own (may_mark, clear_mark)."""
    parts = (comment or "").strip().split(":")
    if len(parts) != 4 or parts[0] != "gpuguard-storm" or parts[1] not in ("intent", "held"):
        return None
    try:
        return (parts[1], parts[2], float(parts[3]))
    except ValueError:
        return None


def test_a_node_not_yet_upgraded_reads_a_switch_held_mark_as_gpuguards_and_never_as_the_check_itself():
    """During an upgrade old and new nodes read each other's Comments. A held mark naming a component must still be
    gpuguard's mark to an old node (else: an admin's Comment it never overwrites, so a node rolled back keeps a stale
    mark it can neither clear nor replace), held, with its time, and not a hold for the check itself (else an old
    node's partition rule counts a switch fault against its own drain: the partition's slots eaten again). Intent
    and partition-storm marks read exactly as before."""
    t = 1733140000.52
    old = _parse_mark_before_components(format_mark("held", "fabric.efa", t, "switch=leaf7"))
    assert old is not None, format_mark("held", "fabric.efa", t, "switch=leaf7")
    assert old[0] == "held" and old[2] == t and old[1] != "fabric.efa" and "leaf7" in old[1]
    assert _parse_mark_before_components(format_mark("held", "fabric.efa", t)) == ("held", "fabric.efa", t)
    assert _parse_mark_before_components(format_mark("intent", "fabric.efa", t)) == ("intent", "fabric.efa", t)
    new = parse_mark(format_mark("held", "fabric.efa", t, "rack=rack-12.b"))
    assert new is not None and (new.state, new.check_id, new.ts, new.component) == ("held", "fabric.efa", t,
                                                                                     "rack=rack-12.b")
    # what the first build with components wrote (a fifth field) still reads, so its nodes can be let go
    five = parse_mark(f"gpuguard-storm:held:fabric.efa:{t:.2f}:switch=leaf7")
    assert five is not None and (five.check_id, five.component) == ("fabric.efa", "switch=leaf7")
    assert may_mark(f"gpuguard-storm:held:fabric.efa:{t:.2f}:switch=leaf7")


def test_a_rack_whose_first_node_the_partition_held_pages_once_when_most_of_it_fails(tmp_path):
    """Through the guard and the marks it writes: n05 and n06 drain (the partition's limit, 2 of 10), n01 (rack12)
    is held by the partition rule and pages that storm. Then n02 and n03 fail in one round: 3 of rack12's 4 nodes,
    the rack is at fault. One page names it (n01, held already, decides nothing now and must not swallow it)."""
    site = tmp_path / "parts.yaml"
    site.write_text("rack:\n  checks: [fabric.efa]\n  nodes:\n    rack12: n[01-04]\n")
    cluster = Cluster(10)
    cfg = make_cfg(tmp_path, notify={"urls": ["json://127.0.0.1:1/x"]},
                   slurm={"scontrol": "/bin/false", "shared_components_file": str(site)})

    def guard_of(node: str) -> StormGuard:
        return StormGuard(cfg, cluster, node, time.time, lambda: 0.3)

    for n in ("n05", "n06"):
        g = guard_of(n)
        assert g.decide(verdict()) is None
        cluster.drain(n, EFA)
        g.after_drain()
    first = guard_of("n01").decide(verdict())
    assert first is not None and [e.dedup_key for e in first.events] == ["gpuguard/storm/gpu/fabric.efa"]
    assert parse_mark(cluster.nodes["n01"]["comment"]).component == ""
    decided: dict[str, object] = {}

    def one(node: str) -> None:
        decided[node] = guard_of(node).decide(verdict())

    threads = [threading.Thread(target=one, args=(n,)) for n in ("n01", "n02", "n03")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(h is not None for h in decided.values())
    pages = [e for h in decided.values() for e in h.events]
    assert [p.dedup_key for p in pages] == ["gpuguard/rack/rack12/fabric.efa"], pages
    assert "Held, not drained: n[01-03]" in pages[0].message
    assert [parse_mark(cluster.nodes[n]["comment"]).component for n in ("n01", "n02", "n03")] == \
        ["", "rack=rack12", "rack=rack12"]
    late = guard_of("n04").decide(verdict())  # the rack's last node fails later: held, no second page
    assert late is not None and late.events == [] and "rack rack12" in late.why
