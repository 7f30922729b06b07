"""Xid judgements applied to a whole fleet at once (issue 9): an Xid code the catalog does not know warns and never
drains; NVLink5 Xids 144-150 follow the driver's own Fatal/Nonfatal token, in the prolog and in the watch daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuguard.model import Severity
from gpuguard.watch.judge import WatchJudge
from gpuguard.xid.catalog import load_catalog

from simnode import MemorySlurm, ctx, make_cfg, run_sim, write_scenario

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
    from notify_servers import WebhookServer

    hook = WebhookServer()
    scen = write_scenario(tmp_path, "s", {"kernel_log": [f"NVRM: Xid (PCI:{PCI}): 199, pid=1, name=x, new code"]})
    cfg = make_cfg(tmp_path, notify={"urls": [hook.url()]})
    slurm = MemorySlurm()
    result = run_sim(ctx("prolog"), cfg, simulate=scen, slurm_client=slurm)
    assert result.verdict.outcome == "warn" and not slurm.calls
    (req,) = hook.wait_for(1)
    text = req["body"]["message"]
    assert "Xid 199" in text and "not in gpuguard's Xid catalog" in text and "n1" in text


# --------------------------------------------------------------------------- one verdict path: `xid scan` and the watch
# Real NVLink5 lines (tests/fixtures/kernel_log/nvlink5_and_driver.txt: a B200 HGX from NVIDIA/TensorRT-LLM#4816 and
# a GB200 from leptonai/gpud#1174). `xid scan` and the watch must say what the health check says about them.

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kernel_log" / "nvlink5_and_driver.txt"


def _fixture_xid_lines() -> list[str]:
    return [ln for ln in FIXTURE.read_text().splitlines() if not ln.startswith("#") and "NVRM: Xid" in ln]


def _xid_scan(path: Path) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "gpuguard", "xid", "scan", "--file", str(path), "--json"],
                       capture_output=True, text=True, timeout=60)
    return p.returncode, json.loads(p.stdout)


def _hook_verdict(tmp_path: Path, lines: list[str]):
    messages = [ln.split("] ", 1)[1] for ln in lines]  # the kernel message without dmesg's timestamp
    scen = write_scenario(tmp_path, "nvl5", {"kernel_log": messages})
    slurm = MemorySlurm()
    return run_sim(ctx("healthcheck", gpus=None), make_cfg(tmp_path), simulate=scen, slurm_client=slurm), slurm


def test_xid_scan_honours_the_nvlink5_nonfatal_token_like_the_health_check(tmp_path):
    nonfatal = [ln for ln in _fixture_xid_lines() if "Nonfatal" in ln]
    assert len(nonfatal) == 2
    log = tmp_path / "b200-dmesg.txt"
    log.write_text("\n".join(nonfatal) + "\n")
    rc, out = _xid_scan(log)
    assert [(e["code"], e["fatal"]) for e in out["events"]] == [(145, False), (145, False)]
    assert rc == 0  # nothing that drains
    hook, slurm = _hook_verdict(tmp_path, nonfatal)
    assert hook.verdict.outcome != "drain" and not slurm.calls  # the health check agrees
    assert out["verdict"]["outcome"] == hook.verdict.outcome


def test_xid_scan_drains_for_the_fatal_nvlink5_event_with_the_health_checks_action(tmp_path):
    lines = _fixture_xid_lines()
    log = tmp_path / "gb200-dmesg.txt"
    log.write_text(FIXTURE.read_text())
    rc, out = _xid_scan(log)
    assert [(e["code"], e["fatal"]) for e in out["events"]] == [(145, False), (149, True), (145, False)]
    assert rc == 1
    hook, _slurm = _hook_verdict(tmp_path, lines)
    assert hook.verdict.outcome == "drain" and out["verdict"]["outcome"] == "drain"
    assert out["verdict"]["action"] == hook.verdict.action.value == "reset"
    # the same reason as the health check's, but for the context in brackets
    assert out["verdict"]["reason"].split(" [")[0] == hook.verdict.reason.split(" [")[0]


def test_watch_verdict_is_the_health_checks_for_every_fixture_xid(tmp_path):
    """The watch's finding for each real Xid line is the one `gpu.xid` gives for the same line in a health check."""
    from gpuguard.checks import CheckInput, get_check
    from gpuguard.kernellog.formats import parse_xid_line
    from gpuguard.model import KernelLogObservation, Observations

    catalog = load_catalog()
    judge = WatchJudge(catalog, window_s=0)
    for line in _fixture_xid_lines():
        we = judge.judge_bytes(line.encode(), 0.0)
        ev = parse_xid_line(line)
        obs = Observations(kernel_log=KernelLogObservation(source="x", events=[ev]))
        want = get_check("gpu.xid")(obs, CheckInput(profile=None, kind="watch", xid_catalog=catalog))  # type: ignore[arg-type]
        got = we.findings[0]
        assert (got.severity, got.keyword, got.action, got.message) == \
            (want[0].severity, want[0].keyword, want[0].action, want[0].message), line
