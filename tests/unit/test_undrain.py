"""The health check lifts only the drains it owns, and only with evidence that the fault was dealt with. Reset-class
drains (issue 9): passing health checks after an Xid 119 prove nothing (the kernel-log cursor simply moved past it);
a driver reload, a reboot or the driver's recovery action back to NONE do. Reboot-class drains wait for a new boot,
and a fault that comes back after every reboot escalates to `replace`. Whole health-check runs on a simulated node
with the in-memory Slurm (what the hook does on a real node: tests/integration/test_healthcheck.py)."""

from __future__ import annotations

from pathlib import Path

import yaml
from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg, run_sim, write_scenario

from gpuguard.slurm.reason import parse_reason

XID119 = "NVRM: Xid (PCI:0000:75:00): 119, pid=2718, name=python3, Timeout after 6s of waiting for RPC response from GPU2 GSP! Expected function 76 (GSP_RM_CONTROL) (0x2080014b 0x5)."


def _hc(tmp_path: Path, body: dict, slurm: MemorySlurm):
    scen = write_scenario(tmp_path, "node", body)
    return run_sim(ctx("healthcheck"), make_cfg(tmp_path), simulate=scen, slurm_client=slurm)


def _reload_driver(tmp_path: Path) -> None:
    """What `rmmod nvidia; nvidia-smi -r; modprobe nvidia` leaves behind: a new /sys/module/nvidia node."""
    (module,) = list((tmp_path / "sim").glob("*/sys/module/nvidia"))
    # kernfs hands out inode numbers cyclically, so a reloaded module's directory has a new one; a test
    # filesystem would reuse the freed number at once, so the old directory is kept out of the way instead
    module.rename(module.with_name("nvidia.unloaded"))
    module.mkdir()


def test_xid119_drain_waits_for_a_reset_then_undrains(tmp_path):
    slurm = MemorySlurm()
    first = _hc(tmp_path, {"kernel_log": [XID119]}, slurm)
    assert first.verdict.action.value == "reset" and "XID119" in (slurm.reason or "")
    for _ in range(3):  # the Xid is behind the cursor now: every check passes, but nothing was reset
        r = _hc(tmp_path, {"kernel_log": [XID119]}, slurm)
        assert r.verdict.outcome == "pass"
        assert r.undrain and r.undrain["decision"] == "wait" and "evidence of a GPU reset" in r.undrain["detail"]
    assert slurm.reason and "XID119" in slurm.reason
    _reload_driver(tmp_path)
    after = _hc(tmp_path, {"kernel_log": [XID119]}, slurm).undrain  # the passes were already there
    assert after["outcome"] == "done" and "after a driver reload" in after["detail"]
    assert slurm.reason is None


def test_recovery_action_back_to_none_is_evidence(tmp_path):
    slurm = MemorySlurm()
    _hc(tmp_path, {"gpus": {"overrides": {2: {"recovery_action": 1}}}}, slurm)  # NVML: GPU_RESET
    assert slurm.reason and "RECOVERY" in slurm.reason
    again = _hc(tmp_path, {"gpus": {"overrides": {2: {"recovery_action": 1}}}}, slurm)
    assert again.verdict.outcome == "drain" and slurm.reason  # still asking for a reset: stays drained
    outcomes = [_hc(tmp_path, {}, slurm).undrain for _ in range(2)]  # the driver says: nothing to do any more
    assert outcomes[-1]["outcome"] == "done" and "recovery action back to NONE" in outcomes[-1]["detail"]


def test_first_fingerprint_is_never_taken_for_a_reload(tmp_path):
    """A node upgraded to this gpuguard with a reset-class drain in place: the first fingerprint the health check
    sees is 'since: unknown', so it cannot pass for a reload after the drain."""
    slurm = MemorySlurm()
    _hc(tmp_path, {"kernel_log": [XID119]}, slurm)
    from gpuguard.store.sqlite import Store

    with Store(str(tmp_path / "state" / "n1.db")) as st:
        st.delete_cursor("driver_fp:n1")
    for _ in range(3):
        r = _hc(tmp_path, {"kernel_log": [XID119]}, slurm)
    assert r.undrain["decision"] == "wait" and slurm.reason


def test_reset_evidence_needs_a_value_read_as_clear():
    """Only a check that failed at drain time and now reads clear (every finding ok) is evidence of a reset; a value
    NVML could not read (incomplete, whether an error or NOT_SUPPORTED) never is."""
    from gpuguard.checks import cleared_only_by_reset
    from gpuguard.model import Finding, Severity
    from gpuguard.pipeline.conditions import Condition, clearing_evidence

    c = Condition(id="1", check_id="gpu.recovery_action", keyword="RECOVERY", action="reset", reason="gpuguard: x",
                  message="GPU 2 needs a reset", first_seen=1000.0, last_seen=1000.0, origin="healthcheck",
                  boot_id="b1")

    def evidence(findings, boot="b1"):
        return clearing_evidence(c, boot_id=boot, findings=findings, driver_since=None, failing_then=set(),
                                 reset_only=cleared_only_by_reset(), undrain_replace=False)

    clear = [Finding("gpu.recovery_action", Severity.OK, "recovery action NONE on every GPU")]
    assert evidence(clear) == "the recovery action back to NONE"
    unknown = [Finding("gpu.recovery_action", Severity.INCOMPLETE, "GPU 2: NVML could not read recovery_action "
                       "(NOT_SUPPORTED)", evidence={"unsupported": True})]
    assert evidence(unknown) is None
    assert evidence([]) is None  # the check did not even run
    assert evidence([], boot="b2") == "a reboot"


def test_recovery_action_unreadable_keeps_the_reset_drain(tmp_path):
    slurm = MemorySlurm()
    _hc(tmp_path, {"gpus": {"overrides": {2: {"recovery_action": 1}}}}, slurm)  # NVML: GPU_RESET
    assert slurm.reason and "RECOVERY" in slurm.reason
    for _ in range(3):  # the field now answers UNKNOWN for GPU 2 (the call succeeds, that one field fails)
        r = _hc(tmp_path, {"gpus": {"overrides": {2: {"field_errors": {"recovery_action": "UNKNOWN"}}}}}, slurm)
        # waits; or, once the unknown has lasted incomplete_escalate_after runs, the verdict itself is a drain
        assert r.verdict.outcome == "drain" or r.undrain["decision"] == "wait"
    assert ("undrain", None) not in slurm.calls and slurm.reason


def test_the_undrain_message_names_the_check_that_drained_the_node(tmp_path):
    """Issue 16: the undrain notification said `check: -`. It names the drain's check (and resolves its alert)."""
    from gpuguard.notify.render import render
    from gpuguard.pipeline.tell import run_events

    slurm = MemorySlurm()
    results = [_hc(tmp_path, {"kernel_log": [XID119]}, slurm) for _ in range(3)]  # drained, then passes
    _reload_driver(tmp_path)
    results.append(_hc(tmp_path, {"kernel_log": [XID119]}, slurm))
    done = [r for r in results if (r.undrain or {}).get("outcome") == "done"]
    assert len(done) == 1 and slurm.reason is None
    (event,) = [e for e in run_events(done[0]) if e.kind == "undrain"]
    assert event.check_id == "gpu.xid"
    assert "check:    gpu.xid" in render(event)[1]


def _hc_example(tmp_path: Path, slurm: MemorySlurm, example: str, cfg=None, **changes):
    """A health check on the node as an example scenario describes it, top-level keys replaced (boot_id: a reboot)."""
    body = {**yaml.safe_load((SCENARIOS / f"{example}.yaml").read_text()), **changes}
    scen = write_scenario(tmp_path, "node", body)
    return run_sim(ctx("healthcheck"), cfg or make_cfg(tmp_path), simulate=scen, slurm_client=slurm)


def test_ecc_dbe_drains_with_reset(tmp_path):
    slurm = MemorySlurm()
    _hc_example(tmp_path, slurm, "ecc-dbe")
    r = parse_reason(slurm.reason)
    assert r.action == "reset" and (r.check_id, r.keyword) in {("gpu.xid", "XID48"), ("gpu.ecc", "ECC")}


def test_reboot_class_fault_waits_for_a_reboot(tmp_path):
    slurm = MemorySlurm()
    _hc_example(tmp_path, slurm, "xid79")
    assert parse_reason(slurm.reason).action == "reboot"
    for _ in range(3):  # GPU back (say, reseated live) but the node never rebooted
        passed = _hc_example(tmp_path, slurm, "healthy-p5")
    assert slurm.reason and passed.verdict.outcome == "pass"
    for _ in range(2):  # rebooted: two passing runs (undrain.passes) on the new boot
        _hc_example(tmp_path, slurm, "healthy-p5", boot_id="6f1e2d3c-0000-4000-8000-00000000b002")
    assert slurm.reason is None and slurm.calls[-1] == ("undrain", None)


def test_fault_that_survives_reboots_escalates_to_replace(tmp_path):
    slurm = MemorySlurm()
    cfg = make_cfg(tmp_path, undrain={"passes": 1})
    for boot in range(1, 4):
        _hc_example(tmp_path, slurm, "xid79", cfg, boot_id=f"00000000-0000-4000-8000-0000000000a{boot}")
        r = parse_reason(slurm.reason)
        assert r.keyword == "XID79"
        if boot < 3:
            assert r.action == "reboot"
            _hc_example(tmp_path, slurm, "healthy-p5", cfg, boot_id=f"00000000-0000-4000-8000-0000000000b{boot}")
            assert slurm.reason is None
    assert r.action == "replace" and "back after 2 reboots" in slurm.reason
