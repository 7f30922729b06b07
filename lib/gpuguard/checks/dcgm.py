"""dcgm.diag: DCGM's own diagnostics (`dcgmi diag -r N`), judged with DCGM's own error severities.

Reads `obs.dcgm` (gpuguard.probes.dcgm.DcgmObservation). A failed test fails the check with the action DCGM
recommends (dcgm_errors.h severities): RESET -> reset the GPU, ISOLATE -> hardware inspection, TRIAGE /
UNKNOWN / none given -> drain. A failure DCGM itself classes as CONFIG (e.g. persistence mode off) or MONITOR is
a warning: a node setting, not the hardware. dcgmi missing, the host engine down, or every test skipped ->
incomplete, never a hardware failure.
"""

from __future__ import annotations

from typing import Any

from gpuguard.checks._util import fail, incomplete, ok, spec_of, warn
from gpuguard.checks.spec import CheckInput
from gpuguard.model import Action, Finding, Observations

SEV_MONITOR, SEV_ISOLATE, SEV_UNKNOWN, SEV_TRIAGE, SEV_CONFIG, SEV_RESET = 1, 2, 3, 4, 5, 6
_ACTION = {SEV_RESET: Action.RESET, SEV_ISOLATE: Action.REPLACE}
_REMEDIATE = {
    Action.RESET: "drain and reset the GPU (`nvidia-smi -r` or reboot), then `dcgmi diag -r 3`",
    Action.REPLACE: "isolate the GPU: run `dcgmi diag -r 3` (or -r 4) and open a hardware ticket with the output",
    Action.DRAIN: "run `dcgmi diag -r 3 -j` by hand and read the failing test's messages; reboot if unsure",
}


def _gpus(gpus: list[int]) -> str:
    return f" on GPU {','.join(map(str, gpus))}" if gpus else ""


def check_dcgm_diag(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    d: Any = obs.dcgm
    if d is None:
        return [incomplete(s, "DCGM diagnostics were not run")]
    if getattr(d, "tool_missing", False):
        return [incomplete(s, "dcgmi not installed: DCGM diagnostics not run", error=d.status.error)]
    if not d.tests:
        return [incomplete(s, f"DCGM diagnostics did not run: {d.error or d.status.error}"[:200],
                           exit_code=d.exit_code)]
    ignore = {str(t).lower() for t in inp.params.get("ignore_tests", []) or []}
    warn_is_fail = bool(inp.params.get("warn_is_fail", False))
    level = f"level {d.level} " if d.level else ""
    findings: list[Finding] = []
    judged = 0
    for t in d.tests:
        if t.name.lower() in ignore or t.status == "skip":
            continue
        judged += 1
        msg = "; ".join(t.messages)[:160] or "no message"
        ev = {"test": t.name, "category": t.category, "status": t.status, "gpus": t.failed_gpus,
              "messages": t.messages[:5], "severities": sorted(t.severities), "dcgm_version": d.version}
        if t.status == "fail":
            sev = t.severities
            hardware = sev - {SEV_CONFIG, SEV_MONITOR}
            if sev and not hardware:
                findings.append(warn(s, f"DCGM {level}{t.name} failed{_gpus(t.failed_gpus)} "
                                     f"(configuration, not hardware): {msg}",
                                     "fix the node setting DCGM names (e.g. `nvidia-smi -pm 1`)", **ev))
                continue
            top = max(hardware) if hardware else SEV_UNKNOWN
            action = _ACTION.get(top, Action.DRAIN)
            findings.append(fail(s, f"DCGM {level}{t.name} failed{_gpus(t.failed_gpus)}: {msg}",
                                 _REMEDIATE[action], action, gpu=t.failed_gpus[0] if len(t.failed_gpus) == 1 else None,
                                 **ev))
        elif t.status == "warn":
            if warn_is_fail:
                findings.append(fail(s, f"DCGM {level}{t.name} warned{_gpus(t.failed_gpus)}: {msg}",
                                     _REMEDIATE[Action.DRAIN], Action.DRAIN, **ev))
            else:
                findings.append(warn(s, f"DCGM {level}{t.name} warned: {msg}", "", **ev))
    if judged == 0:
        return [incomplete(s, f"DCGM {level}ran but skipped every test: nothing was verified",
                           tests=[t.name for t in d.tests])]
    return findings or [ok(s, f"DCGM {level}diagnostics passed ({judged} tests)", dcgm_version=d.version,
                           tests=[t.name for t in d.tests if t.status == "pass"])]
