"""Xid judgements applied to a whole fleet at once (issue 9): an Xid code the catalog does not know warns and never
drains; NVLink5 Xids 144-150 follow the driver's own Fatal/Nonfatal token, in the prolog and in the watch daemon."""

from __future__ import annotations

from gpuguard.model import Severity
from simnode import run_sim
from gpuguard.watch_judge import WatchJudge
from gpuguard.xid import load_catalog

from simnode import MemorySlurm, ctx, make_cfg, write_scenario

PCI = "0000:86:00"  # GPU 3 of the simulated p5.48xlarge


def _run(tmp_path, *lines: str):
    scen = write_scenario(tmp_path, "s", {"kernel_log": [f"NVRM: Xid (PCI:{PCI}): {ln}" for ln in lines]})
    slurm = MemorySlurm()
    result = run_sim(ctx("prolog"), make_cfg(tmp_path), simulate=scen, slurm_client=slurm)
    return result, slurm


def test_unknown_xid_warns_and_does_not_drain(tmp_path):
    result, slurm = _run(tmp_path, "199, pid=1234, name=python3, Something a newer driver reports")
    assert result.verdict.outcome == "warn" and result.exit_code == 0
    assert not slurm.calls
    f = next(f for f in result.findings if f.check_id == "gpu.xid" and f.severity is Severity.WARN)
    assert f.keyword == "XID199" and "Unknown Xid 199" in f.message


def test_nonfatal_nvlink5_event_is_recorded_not_drained(tmp_path):
    result, slurm = _run(tmp_path, "145, RLW_REMAP Nonfatal XC0 i0 Link 02",
                         "149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001 0x00000000 0x00000000 "
                         "0x00000000 0x00000000)")
    assert result.verdict.outcome == "warn" and not slurm.calls


def test_fatal_nvlink5_event_drains_for_a_reset(tmp_path):
    result, slurm = _run(tmp_path, "145, RLW_REMAP Nonfatal XC0 i0 Link 02",
                         "149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 "
                         "0x00000000 0x00000000)")
    assert result.verdict.outcome == "drain" and result.verdict.action.value == "reset"
    assert slurm.calls and "XID149" in slurm.calls[0][1]


def test_watch_never_folds_a_fatal_event_into_nonfatal_repeats():
    judge = WatchJudge(load_catalog(), window_s=300)
    nonfatal = f"NVRM: Xid (PCI:{PCI}): 145, RLW_REMAP Nonfatal XC0 i0 Link 02".encode()
    fatal = f"NVRM: Xid (PCI:{PCI}): 145, RLW_SRC_TRACK Fatal XC0 i0 Link 03 (0x0 0x0 0x0 0x0)".encode()
    first = judge.judge_bytes(nonfatal, 0.0)
    assert first is not None and not first.fatal
    assert judge.judge_bytes(nonfatal, 1.0) is None  # a repeat inside the window is folded
    ev = judge.judge_bytes(fatal, 2.0)
    assert ev is not None and ev.fatal and ev.info.action == "reset"


def test_watch_unknown_code_is_not_fatal():
    judge = WatchJudge(load_catalog(), window_s=300)
    ev = judge.judge_bytes(f"NVRM: Xid (PCI:{PCI}): 231, pid=1, name=x, new".encode(), 0.0)
    assert ev is not None and not ev.fatal and ev.info.severity == "warn"


def test_unknown_xid_alerts_a_human_without_draining(tmp_path):
    """Warn *and* alert: a real local webhook receives one message naming the code, and nothing is drained."""
    from test_notify_servers import WebhookServer

    hook = WebhookServer()
    scen = write_scenario(tmp_path, "s", {"kernel_log": [f"NVRM: Xid (PCI:{PCI}): 199, pid=1, name=x, new code"]})
    cfg = make_cfg(tmp_path, notify={"urls": [hook.url()]})
    slurm = MemorySlurm()
    result = run_sim(ctx("prolog"), cfg, simulate=scen, slurm_client=slurm)
    assert result.verdict.outcome == "warn" and not slurm.calls
    (req,) = hook.wait_for(1)
    text = req["body"]["message"]
    assert "Xid 199" in text and "not in gpuguard's Xid catalog" in text and "n1" in text
