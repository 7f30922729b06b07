"""gpuguard.pipeline.run on a simulated node with the in-memory Slurm: verdicts that stand until applied, the
kernel-log position that commits with them, stage budgets, restricted (no config) judging, RPC-free drained
nodes. The same behaviours on the real cluster: tests/integration/test_own_faults.py."""

from __future__ import annotations

import time
from typing import Optional

import yaml

from gpuguard.pipeline.budget import StageBudget
from gpuguard.pipeline.journal import Journal, journal_for
from gpuguard.slurm.client import NodeState, SlurmError, SlurmTimeout
from gpuguard.store.sqlite import Store

from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg, run_sim

XID119 = ("NVRM: Xid (PCI:0000:86:00): 119, pid=2113, name=python3, Timeout after 6s of waiting for RPC response "
          "from GPU3 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x204).")


class FlakySlurm(MemorySlurm):
    """slurmctld that can be down; counts the calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.rpcs = 0

    def get_node(self, name: str) -> Optional[NodeState]:
        self.rpcs += 1
        if self.down:
            raise SlurmTimeout("scontrol show did not answer within 2s")
        return super().get_node(name)

    def drain(self, name: str, reason: str) -> None:
        self.rpcs += 1
        if self.down:
            raise SlurmError("Unable to contact slurm controller")
        super().drain(name, reason)


class CensusSlurm(FlakySlurm):
    """... that also answers the drain-storm guard's census (counting them)."""

    def __init__(self) -> None:
        super().__init__()
        self.censuses = 0

    def census(self) -> list:
        self.censuses += 1
        return []


def scenario(tmp_path, *lines: str, base: str = "healthy-p5") -> str:
    data = yaml.safe_load((SCENARIOS / f"{base}.yaml").read_text())
    data["kernel_log"] = list(data.get("kernel_log") or []) + list(lines)
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def journal(tmp_path) -> Journal:
    return journal_for(make_cfg(tmp_path), "n1")


def test_a_drain_slurm_could_not_take_stands_until_applied(tmp_path):
    cfg = make_cfg(tmp_path)
    slurm = FlakySlurm()
    run_sim(ctx("prolog", job_id="1"), cfg, scenario(tmp_path), slurm_client=slurm)
    slurm.down = True
    first = run_sim(ctx("prolog", job_id="2"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    assert first.exit_code == 1 and first.drain["outcome"] == "failed"
    assert [p.reason for p in first.pending] == [first.verdict.reason]
    # the Xid is behind the position now, the prolog still refuses: the drain is pending
    second = run_sim(ctx("prolog", job_id="3"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    assert second.verdict.outcome == "pass" and second.exit_code == 1 and second.pending[0].attempts == 2
    slurm.down = False
    third = run_sim(ctx("prolog", job_id="4"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    assert third.exit_code == 1 and [a["outcome"] for a in third.applied] == ["done"] and not third.pending
    assert "XID119" in slurm.reason and not journal(tmp_path).pending
    with Store(str(tmp_path / "state" / "n1.db")) as st:
        rows = [(d["outcome"], d["check_id"]) for d in st.drains("n1")]
    assert rows[0] == ("done", "gpu.xid") and ("failed", "gpu.xid") in rows


def test_without_a_writable_journal_the_position_waits_for_the_drain(tmp_path):
    """Nowhere to keep a pending drain: the store's position does not move past the Xid until the drain happened,
    so the next run judges it again (fail closed)."""
    run_dir = tmp_path / "run"
    run_dir.write_text("a file where the journal's directory should be")
    cfg = make_cfg(tmp_path, store={"runtime_dir": str(run_dir / "sub")})
    slurm = FlakySlurm()
    run_sim(ctx("healthcheck"), cfg, scenario(tmp_path), slurm_client=slurm)
    slurm.down = True
    first = run_sim(ctx("healthcheck"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    assert first.drain["outcome"] == "failed" and any("could not be written" in n for n in first.notes), first.notes
    slurm.down = False
    again = run_sim(ctx("healthcheck"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    # judged again (the store's position stayed before it); its condition, kept in the durable copy, is applied
    assert again.verdict.outcome == "drain" and again.agreement["outcome"] == "applied"
    assert "XID119" in slurm.reason and "standing" not in slurm.reason


def test_a_node_gpuguard_keeps_drained_costs_one_read_of_its_own_state(tmp_path):
    """Issue 27 item 12: while a condition stands each health check reads this one node's state (one single-node
    RPC: Slurm's truth now, never "known from the store"), and nothing else: no drain, no census of the cluster."""
    cfg = make_cfg(tmp_path, policy={"storm_min_nodes": 1})
    slurm = CensusSlurm()
    first = run_sim(ctx("healthcheck"), cfg, str(SCENARIOS / "missing-gpu.yaml"), slurm_client=slurm)
    assert first.drain["outcome"] == "done"
    before, censuses = slurm.rpcs, slurm.censuses
    for _ in range(3):
        r = run_sim(ctx("healthcheck"), cfg, str(SCENARIOS / "missing-gpu.yaml"), slurm_client=slurm)
        assert r.drain["outcome"] == "kept" and r.verdict.outcome == "drain" and r.agreement["outcome"] == "agreed"
    assert slurm.rpcs - before == 3 and slurm.censuses == censuses, (slurm.rpcs - before, slurm.censuses)


def test_the_health_check_hook_exits_0_and_a_manual_check_says_1(tmp_path):
    cfg = make_cfg(tmp_path)
    hook = run_sim(ctx("healthcheck"), cfg, str(SCENARIOS / "xid79.yaml"), slurm_client=MemorySlurm(), hook=True)
    assert hook.verdict.outcome == "drain" and hook.exit_code == 0
    manual = run_sim(ctx("healthcheck", node="n2"), cfg, str(SCENARIOS / "xid79.yaml"), slurm_client=MemorySlurm(),
                     dry_run=True)
    assert manual.exit_code == 1


def test_with_no_readable_config_only_unambiguous_evidence_drains(tmp_path):
    cfg = make_cfg(tmp_path)
    cfg.mode = "defaults"
    hot = run_sim(ctx("healthcheck"), cfg, str(SCENARIOS / "hot-gpu.yaml"), slurm_client=MemorySlurm())
    assert hot.verdict.outcome == "warn" and any("no readable configuration" in f.message for f in hot.findings)
    gone = run_sim(ctx("healthcheck", node="n2"), cfg, str(SCENARIOS / "xid79.yaml"), slurm_client=MemorySlurm())
    assert gone.verdict.outcome == "drain"


def test_gathering_leaves_the_act_stage_its_share_of_the_deadline():
    b = StageBudget(20.0, scontrol_s=5.0)
    assert abs((b.gather.end - b.total.start) - 14.0) < 0.01
    short = StageBudget(4.0, scontrol_s=5.0)  # never more than half the run for acting
    assert abs((short.gather.end - short.total.start) - 1.5) < 0.01


def test_a_broken_config_is_noted_once_and_resolved(tmp_path):
    from gpuguard.config.schema import ConfigIssue

    cfg = make_cfg(tmp_path)
    cfg.mode, cfg.issues = "partial", [ConfigIssue("deadlines.prolog_s", 7, "expected a number > 0, got 'soon'")]
    first = run_sim(ctx("prolog", job_id="1"), cfg, str(SCENARIOS / "healthy-p5.yaml"), slurm_client=MemorySlurm())
    assert [e.check_id for e in first.events] == ["config"] and first.config_issues
    assert journal(tmp_path).config["issues"] == ["line 7: deadlines.prolog_s: expected a number > 0, got 'soon'"]
    again = run_sim(ctx("prolog", job_id="2"), cfg, str(SCENARIOS / "healthy-p5.yaml"), slurm_client=MemorySlurm())
    assert not again.events, "one page per episode"
    fixed = run_sim(ctx("prolog", job_id="3"), make_cfg(tmp_path), str(SCENARIOS / "healthy-p5.yaml"),
                    slurm_client=MemorySlurm())
    assert [(e.check_id, e.state) for e in fixed.events] == [("config", "resolved")] and not journal(tmp_path).config


def test_a_damaged_journal_is_moved_aside_and_the_store_copy_used(tmp_path):
    cfg = make_cfg(tmp_path)
    slurm = MemorySlurm()
    run_sim(ctx("healthcheck"), cfg, scenario(tmp_path), slurm_client=slurm)
    path = tmp_path / "run" / "n1.journal.json"
    path.write_text("{not json")
    r = run_sim(ctx("healthcheck"), cfg, scenario(tmp_path), slurm_client=slurm)
    assert r.verdict.outcome == "pass" and any("unreadable" in n for n in r.notes)
    assert list((tmp_path / "run").glob("n1.journal.json.damaged-*"))
    assert journal(tmp_path).positions.get("kernel_log")


def test_a_run_reads_one_clock(tmp_path):
    """Issue 15 "one clock": every time a run keeps (when it started, when a pending drain was decided and last
    tried, what the store records) comes from the clock its caller hands it, so a test can put a run at any moment
    without sleeping for a wall-clock window."""
    cfg = make_cfg(tmp_path)
    slurm = FlakySlurm()
    t0 = 2_000_000_000.0  # 2033-05-18
    run_sim(ctx("healthcheck"), cfg, scenario(tmp_path), slurm_client=slurm, clock=lambda: t0)
    slurm.down = True
    first = run_sim(ctx("healthcheck"), cfg, scenario(tmp_path, XID119), slurm_client=slurm, clock=lambda: t0 + 60)
    assert first.started == t0 + 60 and first.observations.now == t0 + 60
    (p,) = journal(tmp_path).pending
    assert p.created == t0 + 60 and p.last_attempt == t0 + 60
    slurm.down = False
    later = run_sim(ctx("healthcheck"), cfg, scenario(tmp_path, XID119), slurm_client=slurm, clock=lambda: t0 + 3600)
    assert [a["outcome"] for a in later.applied] == ["done"] and later.started == t0 + 3600
    with Store(str(tmp_path / "state" / "n1.db")) as st:
        assert {r["started"] for r in st.runs("n1")} == {t0, t0 + 60, t0 + 3600}


def test_a_drain_the_health_check_could_not_apply_is_paged_once_while_it_is_pending(tmp_path, hook):
    """slurmctld unreachable: the health check's drain waits in the journal (prologs refuse jobs meanwhile). A
    human hears it now, once, not only when slurmctld is back (issue 27)."""
    cfg = make_cfg(tmp_path, notify={"urls": [hook.url("/pages")]})
    slurm = FlakySlurm()
    run_sim(ctx("healthcheck"), cfg, scenario(tmp_path), slurm_client=slurm)
    slurm.down = True
    first = run_sim(ctx("healthcheck"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    assert first.drain["outcome"] == "failed" and first.pending
    second = run_sim(ctx("healthcheck"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    assert second.pending  # still pending
    pages = [r["body"] for r in hook.wait_for(1)]
    time.sleep(0.5)
    titles = [r["body"]["title"] for r in hook.requests]
    assert titles == ["gpuguard: DRAIN PENDING n1 gpu.xid"], titles
    assert "XID119" in pages[0]["message"] and "jobs are refused until it is applied" in pages[0]["message"]
    slurm.down = False
    run_sim(ctx("healthcheck"), cfg, scenario(tmp_path, XID119), slurm_client=slurm)
    assert "XID119" in slurm.reason
    assert len(hook.wait_for(2)) == 2 and hook.requests[1]["body"]["title"] == "gpuguard: DRAINED n1 gpu.xid"
