"""Node conditions (issue 27): a fatal finding stands as a condition of the node until what clears it is seen;
the journal keeps them (and a durable copy outlives a reboot); every hook makes Slurm agree with them first."""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
from simnode import MemorySlurm, make_cfg

from gpuguard.model import Action, Finding, Severity, Verdict
from gpuguard.pipeline.act import SlurmHandle
from gpuguard.pipeline.conditions import (Condition, clearing_evidence, conditions_from_verdict, first_standing,
                                          merge, parse_undrain_token, standing, standing_reason, undrain_token)
from gpuguard.pipeline.journal import conditions_copy_path, journal_for
from gpuguard.pipeline.reconcile import agree, clear_by_reboot
from gpuguard.slurm.client import NodeState, SlurmError

XID119 = "gpuguard: XID119 gpu.xid: GSP RPC timeout on 0000:53:00 [healthcheck reset]"


def fail(check: str, keyword: str, action: Action, gpu: Optional[int] = None, **evidence: Any) -> Finding:
    return Finding(check, Severity.FAIL, f"{keyword} seen", gpu=gpu, keyword=keyword, action=action,
                   evidence=evidence)


def verdict(*failing: Finding, reason: str = XID119) -> Verdict:
    return Verdict(outcome="drain", action=max((f.action for f in failing), key=lambda a: a.rank), reason=reason,
                   primary=failing[0], failing=list(failing))


def cond(action: str = "reset", check: str = "gpu.xid", keyword: str = "XID119", first_seen: float = 100.0,
         boot_id: Optional[str] = "boot-a", **kw: Any) -> Condition:
    fields: dict[str, Any] = {"message": "GSP RPC timeout", **kw}
    return Condition(id=f"{check}-{keyword}", check_id=check, keyword=keyword, action=action, reason=XID119,
                     first_seen=first_seen, last_seen=first_seen, origin="healthcheck", boot_id=boot_id, **fields)


# --------------------------------------------------------------------------- from a verdict, merged, standing

def test_a_drain_verdict_becomes_one_condition_per_fault_with_the_primary_first():
    v = verdict(fail("gpu.xid", "XID119", Action.RESET, gpu=2, pci="0000:53:00.0"),
                fail("gpu.xid", "XID119", Action.RESET, gpu=5),
                fail("gpu.temperature", "THERMAL", Action.DRAIN, gpu=1))
    conds = conditions_from_verdict(v, "prolog", 1000.0, "boot-a", run_id=7)
    assert [(c.check_id, c.keyword, c.action) for c in conds] == [("gpu.xid", "XID119", "reset"),
                                                                   ("gpu.temperature", "THERMAL", "drain")]
    xid = conds[0]
    assert xid.reason == XID119 and xid.gpus == ["0000:53:00.0", "2", "5"] and xid.evidence == {"pci": "0000:53:00.0"}
    assert xid.failing_with == ["gpu.temperature", "gpu.xid"] and (xid.run_id, xid.boot_id) == (7, "boot-a")
    assert conds[1].reason.endswith("[prolog]")  # a secondary fault's own reason, should it be the one left
    assert conditions_from_verdict(Verdict(outcome="pass"), "prolog", 1.0, None) == []


def test_a_fault_seen_again_updates_its_condition_and_one_seen_after_it_cleared_stands_anew():
    old = cond(first_seen=10.0)
    again = cond(first_seen=50.0)
    again.id = "new"
    conds, new = merge([old], [again])
    assert new == [] and conds == [old] and (old.first_seen, old.last_seen) == (10.0, 50.0)
    worse = cond(action="replace", first_seen=60.0)
    conds, _ = merge(conds, [worse])
    assert old.action == "replace"  # escalated (e.g. recurred across reboots)
    old.cleared_by = "a reboot"
    conds, new = merge(conds, [again])
    assert new == [again] and conds == [again] and standing(conds) == [again]


def test_the_reason_slurm_shows_is_the_strongest_oldest_condition():
    a, b, c = cond("drain", keyword="TEMP", first_seen=1), cond("reset", first_seen=5), cond("reset", keyword="X",
                                                                                              first_seen=3)
    assert first_standing([a, b, c]) is c
    c.cleared_by = "x"
    assert first_standing([a, b, c]) is b


def test_a_re_drain_reason_says_how_to_clear_the_condition():
    r = standing_reason(cond("reset"), "node7")
    assert r.startswith("gpuguard: XID119 gpu.xid: reset GPU then gpuguard undrain node7") and "[standing reset]" in r
    assert "reboot the node" in standing_reason(cond("reboot"), "node7")
    assert len(standing_reason(cond("replace", message="x" * 500), "node7")) <= 120


# --------------------------------------------------------------------------- what clears a condition

OK_ECC = Finding("gpu.ecc", Severity.OK, "no pending retirements")


@pytest.mark.parametrize("action, kw, cleared", [
    # a plain resume / the check reading clear is no evidence for a reset-class fault
    ("reset", {}, None),
    ("reset", {"boot_id": "boot-b"}, "a reboot"),
    ("reset", {"driver_since": 200.0}, "a driver reload"),
    ("reset", {"driver_since": 50.0}, None),  # the driver was loaded before the fault
    ("reset", {"failing_then": ["gpu.ecc"], "findings": [OK_ECC]}, "pending retirements cleared"),
    ("reboot", {"boot_id": "boot-b"}, "a reboot"),
    ("reboot", {"driver_since": 200.0}, None),
    ("replace", {"boot_id": "boot-b"}, None),
    ("replace", {"findings": [Finding("gpu.xid", Severity.OK, "none")]}, None),
    ("replace", {"findings": [Finding("gpu.xid", Severity.OK, "none")], "undrain_replace": True},
     "the check passing again"),
    ("drain", {"findings": [Finding("gpu.xid", Severity.OK, "none")]}, "the check passing again"),
    ("drain", {"findings": [Finding("gpu.xid", Severity.WARN, "unreadable")]}, None),  # unreadable is never clear
    ("drain", {"findings": []}, None),  # the check did not run
])
def test_each_class_of_condition_is_cleared_only_by_its_own_evidence(action, kw, cleared):
    args: dict[str, Any] = {"boot_id": "boot-a", "findings": [], "driver_since": None, "failing_then": [],
                            "reset_only": {"gpu.ecc": "pending retirements cleared"}, "undrain_replace": False, **kw}
    assert clearing_evidence(cond(action), **args) == cleared


def test_a_driver_reload_is_a_module_other_than_the_one_the_fault_was_found_under():
    c = cond("reset", driver_fp="7:100")
    args: dict[str, Any] = {"boot_id": "boot-a", "findings": [], "failing_then": [], "reset_only": {},
                            "undrain_replace": False}
    assert clearing_evidence(c, driver_fp="7:101", driver_since=None, **args) == "a driver reload"
    # the same module: no reload, whatever a store that never saw it before says about "since"
    assert clearing_evidence(c, driver_fp="7:100", driver_since=1e12, **args) is None
    assert clearing_evidence(c, driver_fp=None, driver_since=1e12, **args) is None  # no module loaded now


def test_a_fault_found_again_in_the_same_run_is_never_cleared():
    again = fail("gpu.xid", "XID119", Action.RESET)
    assert clearing_evidence(cond("reset"), boot_id="boot-b", findings=[again], driver_since=None, failing_then=[],
                             reset_only={}, undrain_replace=True) is None


def test_an_undrain_token_in_a_node_comment_is_read_back_and_hostile_names_are_tamed():
    tok = undrain_token(1700000000.9, "alice;$(reboot) x")
    assert tok == "gpuguard-undrain:1700000000:alice" + "reboot" + "x"
    assert parse_undrain_token(tok) == (1700000000.0, "alicerebootx")
    for other in (None, "", "maintenance window", "gpuguard-undrain:soon:bob", "gpuguard-undrain:1:a:b"):
        assert parse_undrain_token(other) is None


# --------------------------------------------------------------------------- the journal and its durable copy

def test_conditions_outlive_the_runtime_journal_through_their_durable_copy(tmp_path):
    cfg = make_cfg(tmp_path)
    j = journal_for(cfg, "n1")
    j.conditions = [cond("replace")]
    assert j.save() is None
    copy = conditions_copy_path(cfg, "n1")
    assert copy == str(tmp_path / "state" / "conditions" / "n1.json") and os.path.exists(copy)
    os.unlink(j.path)  # a reboot emptied /run
    back = journal_for(cfg, "n1")
    assert [c.to_dict() for c in back.conditions] == [c.to_dict() for c in j.conditions] and back.error is None


def test_a_copy_that_could_not_be_written_is_written_by_the_next_save(tmp_path):
    cfg = make_cfg(tmp_path)
    copy_dir = tmp_path / "state" / "conditions"
    copy_dir.parent.mkdir(parents=True)
    copy_dir.write_text("not a directory")  # the copy cannot be written
    j = journal_for(cfg, "n1")
    j.conditions = [cond()]
    j.save()
    assert "could not be written" in (j.error or "")
    again = journal_for(cfg, "n1")
    assert standing(again.conditions) and again.saved_conditions is None  # the journal knows the copy lags
    copy_dir.unlink()
    assert again.save() is None and os.path.exists(conditions_copy_path(cfg, "n1"))


def test_a_damaged_copy_is_loud_and_never_raises(tmp_path):
    cfg = make_cfg(tmp_path)
    path = conditions_copy_path(cfg, "n1")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    j = journal_for(cfg, "n1")
    assert j.conditions == [] and "unreadable" in (j.error or "")


def test_a_reboot_clears_reset_and_reboot_class_conditions_but_not_a_replace_one(tmp_path):
    j = journal_for(make_cfg(tmp_path), "n1")
    j.conditions = [cond("reset"), cond("reboot", keyword="XID79"), cond("replace", keyword="XID48")]
    cleared = clear_by_reboot(j, "boot-b", 500.0)
    assert [c.keyword for c in cleared] == ["XID119", "XID79"] and [c.keyword for c in standing(j.conditions)] == \
        ["XID48"]
    assert clear_by_reboot(j, "boot-b", 600.0) == []


# --------------------------------------------------------------------------- making Slurm agree

class CommentSlurm(MemorySlurm):
    def __init__(self, reason: Optional[str] = None, states: frozenset[str] = frozenset({"IDLE"}),
                 comment: str = "", broken: bool = False) -> None:
        super().__init__(reason, states)
        self.comment, self.broken = comment, broken

    def get_node(self, name: str) -> Optional[NodeState]:
        if self.broken:
            raise SlurmError("slurmctld did not answer in 5s")
        st = super().get_node(name)
        assert st is not None
        return NodeState(name=st.name, states=st.states, reason=st.reason, fields={"Comment": self.comment})

    def set_comment(self, name: str, comment: str) -> None:
        self.calls.append(("comment", comment))
        self.comment = comment


def standing_journal(tmp_path, applied: bool = True) -> Any:
    j = journal_for(make_cfg(tmp_path), "n1")
    j.conditions = [cond("reset", first_seen=100.0, applied=applied)]
    return j


def run_agree(tmp_path, slurm: CommentSlurm, applied: bool = True) -> tuple[dict[str, Any], Any]:
    j = standing_journal(tmp_path, applied)
    return agree(j, SlurmHandle(make_cfg(tmp_path), None, slurm), "n1", 1000.0), j


def test_a_plain_resume_while_a_condition_stands_is_drained_again_with_how_to_clear_it(tmp_path):
    slurm = CommentSlurm()
    out, j = run_agree(tmp_path, slurm)
    assert out["outcome"] == "redrained" and slurm.calls == [("drain", out["reason"])]
    assert "reset GPU then gpuguard undrain n1" in slurm.reason and "[standing reset]" in slurm.reason
    assert standing(j.conditions)


def test_a_condition_whose_drain_never_reached_slurm_is_drained_with_its_own_reason(tmp_path):
    slurm = CommentSlurm()
    out, j = run_agree(tmp_path, slurm, applied=False)
    assert out["outcome"] == "applied" and slurm.reason == XID119 and j.conditions[0].applied


def test_slurms_own_prolog_error_drain_is_replaced_by_the_conditions_reason(tmp_path):
    slurm = CommentSlurm(reason="Prolog error")
    out, _ = run_agree(tmp_path, slurm)
    assert out["outcome"] == "replaced" and slurm.reason == XID119
    down = CommentSlurm(reason="Not responding", states=frozenset({"DOWN"}))
    out, _ = run_agree(tmp_path, down)
    assert out["outcome"] == "replaced" and down.reason == XID119


@pytest.mark.parametrize("reason, states, outcome", [
    (XID119, frozenset({"IDLE"}), "agreed"),
    ("cable swap - bob", frozenset({"IDLE"}), "admin"),
    ("bob: down for bios", frozenset({"DOWN"}), "admin"),
    (None, frozenset({"IDLE", "MAINTENANCE"}), "admin"),
])
def test_a_drain_gpuguard_or_an_admin_already_holds_is_left_alone(tmp_path, reason, states, outcome):
    slurm = CommentSlurm(reason=reason, states=states)
    out, j = run_agree(tmp_path, slurm)
    assert out["outcome"] == outcome and slurm.calls == [] and standing(j.conditions)


def test_an_unreachable_slurmctld_leaves_a_pending_drain_and_the_condition(tmp_path):
    out, j = run_agree(tmp_path, CommentSlurm(broken=True))
    assert out["outcome"] == "pending" and [(p.op, p.reason) for p in j.pending] == [("drain", XID119)]
    assert j.pending[0].attempts == 1 and "did not answer" in (j.pending[0].last_error or "")


def test_an_admins_remote_undrain_token_clears_what_it_saw_and_is_removed(tmp_path):
    slurm = CommentSlurm(comment="gpuguard-undrain:500:alice")
    out, j = run_agree(tmp_path, slurm)
    assert out["outcome"] == "cleared" and not standing(j.conditions)
    assert "alice" in (j.conditions[0].cleared_by or "") and slurm.calls == [("comment", "")]
    # a token older than the fault clears nothing
    slurm = CommentSlurm(comment="gpuguard-undrain:50:alice")
    out, j = run_agree(tmp_path, slurm)
    assert out["outcome"] == "redrained" and standing(j.conditions)
