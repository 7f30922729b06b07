"""Verdicts: hardware fails closed, incompletes warn then escalate, the reason names the root cause."""

from gpuguard.model import Action, Finding, Severity
from gpuguard.pipeline.policy import decide
from gpuguard.slurm.reason import parse_reason


def F(cid, sev, kw="", action=Action.NONE, msg="m", **ev):
    return Finding(cid, sev, msg, keyword=kw, action=action, evidence=ev)


def test_all_ok_passes():
    v = decide([F("gpu.ecc", Severity.OK), F("gpu.nvlink", Severity.SKIP)], "prolog")
    assert v.outcome == "pass" and v.reason is None


def test_fail_drains_with_root_cause_first_and_strongest_action():
    fs = [F("gpu.count", Severity.FAIL, "GPUCOUNT", Action.REBOOT, "8 GPUs expected, NVML sees 7"),
          F("gpu.xid", Severity.FAIL, "XID79", Action.REBOOT, "GPU has fallen off the bus on 0000:86:00"),
          F("sys.disk", Severity.FAIL, "DISK", Action.DRAIN, "/tmp full")]
    v = decide(fs, "prolog")
    assert v.outcome == "drain" and v.action is Action.REBOOT
    p = parse_reason(v.reason)
    assert p.check_id == "gpu.xid" and p.keyword == "XID79" and p.action == "reboot"
    assert v.reason.endswith("+2 more [prolog reboot]")


def test_replace_outranks_reboot():
    fs = [F("gpu.xid", Severity.FAIL, "XID79", Action.REBOOT), F("gpu.row_remap", Severity.FAIL, "ROWREMAP", Action.REPLACE)]
    v = decide(fs, "healthcheck")
    assert v.action is Action.REPLACE and parse_reason(v.reason).check_id == "gpu.row_remap"


def test_report_policy_never_drains():
    v = decide([F("gpu.ecc", Severity.FAIL, "ECC", Action.RESET)], "prolog", on_failure="report")
    assert v.outcome == "warn" and v.reported_only and v.reason


def test_incomplete_warns_then_escalates():
    inc = [F("fabric.efa", Severity.INCOMPLETE, "EFA", msg="fi_info timed out after 5s")]
    assert decide(inc, "prolog").outcome == "warn"
    assert decide(inc, "prolog", incomplete_history={"fabric.efa": 1}).outcome == "warn"
    v = decide(inc, "prolog", incomplete_history={"fabric.efa": 2})
    assert v.outcome == "drain" and v.escalated == ["fabric.efa"]
    assert parse_reason(v.reason).keyword == "TIMEOUT" and "3 runs in a row" in v.reason
    assert decide(inc, "prolog", incomplete_escalate_after=0, incomplete_history={"fabric.efa": 50}).outcome == "warn"
    assert decide(inc, "prolog", on_incomplete="drain").outcome == "drain"


def test_unsupported_incompletes_never_escalate_to_a_drain():
    """NOT_SUPPORTED from the driver or GPU is the same on every node of a platform: escalating it would drain the
    fleet. It stays a warning however often it repeats (and never counts as clear: see test_undrain.py)."""
    inc = [F("gpu.nvlink", Severity.INCOMPLETE, "NVLINK", msg="NVLink state not readable (NOT_SUPPORTED)",
             unsupported=True)]
    assert decide(inc, "healthcheck", incomplete_history={"gpu.nvlink": 50}).outcome == "warn"
    assert decide(inc, "healthcheck", on_incomplete="drain").outcome == "warn"
    plain = [F("gpu.ecc", Severity.INCOMPLETE, "ECC", msg="NVML could not read ecc_volatile_uncorrected (UNKNOWN)")]
    assert decide(plain, "healthcheck", incomplete_history={"gpu.ecc": 2}).outcome == "drain"


def test_internal_errors_never_escalate_to_a_hardware_drain():
    inc = [F("gpu.ecc", Severity.INCOMPLETE, "INTERNAL", internal_error=True)]
    assert decide(inc, "prolog", on_incomplete="drain", incomplete_history={"gpu.ecc": 9}).outcome == "warn"
