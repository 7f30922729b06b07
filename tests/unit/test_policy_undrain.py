"""Undrain and escalation decisions (pure): ownership first, reboot-class waits for a reboot, flapping."""

import pytest

from gpuguard.model import Action, Finding, Severity
from gpuguard.pipeline.policy import decide_undrain, escalate_recurring
from gpuguard.slurm.reason import format_reason

OURS = format_reason("gpu.row_remap", "ROWREMAP", "GPU 2 (0000:75:00.0): row remapping pending", "healthcheck", "reset")


def d(**kw):
    base = dict(drain_action="reset", node_drained=True, node_reason=OURS, node_down=False, node_maintenance=False,
                verdict="pass", passes=2, required_passes=2, boot_changed=False, undrains_in_window=0, max_undrains=3)
    base.update(kw)
    return decide_undrain(**base)


def test_undrains_after_enough_passes():
    assert d(drain_action="drain").action == "undrain"
    assert d(drain_action="drain", passes=1).action == "wait"
    assert d(drain_action="drain", verdict="drain").action == "wait"


def test_reset_class_needs_evidence_of_a_reset():
    """Passing health checks after a reset-class drain (Xid 119/120/62/..., recovery action GPU_RESET, a pending
    row remap) prove nothing: the log cursor simply moved past the Xid. Only a reset does."""
    waiting = d(passes=50)
    assert waiting.action == "wait" and "evidence of a GPU reset" in waiting.detail
    assert d(reset_evidence="a driver reload").action == "undrain"
    assert "after a driver reload" in d(reset_evidence="a driver reload").detail
    assert d(boot_changed=True).action == "undrain"
    assert d(reset_evidence="a driver reload", passes=1).action == "wait"  # ... and the passes still count


def test_never_touches_an_admin_reason_or_a_resumed_node():
    assert d(node_reason="admin: swapping PSU").action == "closed"
    assert d(node_drained=False).action == "closed"
    assert d(node_down=True).action == "wait" and d(node_maintenance=True).action == "wait"


def test_reboot_class_needs_a_new_boot():
    assert d(drain_action="reboot").action == "wait" and "reboot" in d(drain_action="reboot").detail
    assert d(drain_action="reboot", boot_changed=True).action == "undrain"


def test_replace_class_is_for_an_admin():
    assert d(drain_action="replace", boot_changed=True).action == "admin"
    assert d(drain_action="replace", undrain_replace=True).action == "undrain"


def test_flapping():
    assert d(undrains_in_window=3, drain_action="drain").action == "flapping"
    flapping = format_reason("gpu.xid", "FLAPPING", "drained again", "healthcheck", "replace")
    assert d(node_reason=flapping).action == "flapping"
    assert d(undrains_in_window=50, max_undrains=0, drain_action="drain").action == "undrain"  # 0 = no flapping rule


def F(action, kw="XID79", cid="gpu.xid"):
    return Finding(cid, Severity.FAIL, "GPU has fallen off the bus on 0000:86:00", keyword=kw, action=action)


@pytest.mark.parametrize("seen,expected", [(0, Action.REBOOT), (1, Action.REBOOT), (2, Action.REPLACE)])
def test_reboot_fault_escalates_after_n_reboots(seen, expected):
    out = escalate_recurring([F(Action.REBOOT)], {("gpu.xid", "XID79"): seen}, escalate_after=2)[0]
    assert out.action is expected
    if expected is Action.REPLACE:
        assert "back after 2 reboots" in out.message and out.evidence["recurred_boots"] == 2


def test_only_the_same_fault_escalates():
    out = escalate_recurring([F(Action.RESET, kw="XID48")], {("gpu.xid", "XID79"): 5}, escalate_after=2)[0]
    assert out.action is Action.RESET
    assert escalate_recurring([F(Action.REBOOT)], {("gpu.xid", "XID79"): 5}, escalate_after=0)[0].action is Action.REBOOT
