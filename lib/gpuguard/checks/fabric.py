"""Fabric checks: EFA (AWS) and InfiniBand devices from sysfs, libfabric provider from fi_info."""

from __future__ import annotations

import fnmatch
import re

from gpuguard.checks import CheckInput
from gpuguard.checks._util import fail, incomplete, ok, skip
from gpuguard.model import Action, Finding, Observations, RdmaDevice

_REMEDIATE_EFA = ("check `fi_info -p efa` and `ls /sys/class/infiniband`; the EFA driver or a device failed: "
                  "reboot (a stop/start moves the instance to new hardware), replace if it persists")
_REMEDIATE_IB = "check `ibstat` / `ibv_devinfo`, cables and the switch port; reboot, reseat or replace the HCA"


def _down_ports(devs: list[RdmaDevice]) -> list[str]:
    return [f"{d.name}/{p.port}:{p.state or '?'}" for d in devs for p in d.ports if (p.state or "").upper() != "ACTIVE"]


def check_efa(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "fabric.efa"
    expected = inp.profile.efa_devices
    if not expected:
        return [skip(cid, "profile expects no EFA devices")]
    fab = obs.fabric
    if fab is None:
        return [incomplete(cid, "EFA", "fabric not read")]
    efa = [d for d in fab.devices if d.kind == "efa"]
    findings: list[Finding] = []
    if len(efa) < expected:
        # A device that is not there: a failed card or an instance launched with fewer EFA interfaces (a launch
        # template applied to a whole fleet). Drain for an admin; a reboot cannot attach an interface, and a reboot
        # action would escalate to "replace" after two.
        findings.append(fail(cid, "EFA", f"{expected} EFA devices expected, {len(efa)} found", _REMEDIATE_EFA,
                             Action.DRAIN, expected=expected, found=len(efa), devices=[d.name for d in efa]))
    down = _down_ports(efa)
    if down:
        findings.append(fail(cid, "EFA", f"EFA port not ACTIVE: {', '.join(down[:4])}"
                             + (f" +{len(down) - 4} more" if len(down) > 4 else ""), _REMEDIATE_EFA,
                             Action.REBOOT, down=down))
    if inp.profile.libfabric_provider and inp.params.get("check_provider", True):
        fi = fab.fi_info
        if fi is None or not fi.ran:
            findings.append(incomplete(cid, "EFA", f"fi_info did not run: {fi.error if fi else 'not configured'}"))
        elif not fi.provider_found:
            # software on the node (libfabric / the EFA installer), not hardware: drain, never reboot-escalate
            findings.append(fail(cid, "EFA", f"libfabric provider {inp.profile.libfabric_provider} not available",
                                 _REMEDIATE_EFA, Action.DRAIN, error=fi.error))
        elif fi.devices < expected:
            findings.append(fail(cid, "EFA", f"libfabric sees {fi.devices} EFA devices, {expected} expected",
                                 _REMEDIATE_EFA, Action.DRAIN, fi_info_devices=fi.devices))
    if not fab.status.complete and not findings:
        findings.append(incomplete(cid, "EFA", f"fabric probe incomplete: {fab.status.error}"))
    return findings or [ok(cid, f"{len(efa)} EFA devices, ports ACTIVE, provider ok", devices=len(efa))]


def _rate_gbps(rate: str | None) -> float | None:
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
    return float(m.group(1)) if m else None


def check_ib(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "fabric.ib"
    expected = inp.profile.ib_devices
    if not expected:
        return [skip(cid, "profile expects no InfiniBand devices")]
    fab = obs.fabric
    if fab is None:
        return [incomplete(cid, "IB", "fabric not read")]
    names = inp.profile.ib_compute_devices
    if names:  # only the compute HCAs: storage ports on the same node may be legitimately uncabled
        ib = [d for d in fab.devices if d.kind == "ib" and d.name in names]
    else:
        pattern = inp.profile.ib_device_pattern or "*"
        ib = [d for d in fab.devices if d.kind == "ib" and fnmatch.fnmatch(d.name, pattern)]
    findings: list[Finding] = []
    if len(ib) < expected:
        missing = sorted(set(names) - {d.name for d in ib}) if names else []
        what = f" (missing {','.join(missing[:4])})" if missing else ""
        findings.append(fail(cid, "IB", f"{expected} InfiniBand HCAs expected, {len(ib)} found{what}", _REMEDIATE_IB,
                             Action.DRAIN, expected=expected, found=[d.name for d in ib]))
    down = _down_ports(ib)
    if down:
        findings.append(fail(cid, "IB", f"IB port not ACTIVE: {', '.join(down[:4])}"
                             + (f" +{len(down) - 4} more" if len(down) > 4 else ""), _REMEDIATE_IB,
                             Action.DRAIN, down=down))
    want = inp.profile.ib_rate_gbps
    if want:
        slow = [f"{d.name}/{p.port}:{p.rate}" for d in ib for p in d.ports
                if (p.state or "").upper() == "ACTIVE" and (_rate_gbps(p.rate) or 0) < want]
        if slow:
            findings.append(fail(cid, "IB", f"IB link below {want} Gb/s: {', '.join(slow[:3])}", _REMEDIATE_IB,
                                 Action.DRAIN, slow=slow))
    return findings or [ok(cid, f"{len(ib)} InfiniBand HCAs ACTIVE")]
