"""Fabric checks: fabric.efa (EFA devices from sysfs, libfabric provider from fi_info), fabric.ib (InfiniBand).

Device counts below the profile are judged against the node's own history (gpuguard.checks.inventory): a device
this node had and lost drains; fewer than the profile on a node that never had more (a p5 launched with 4 of its
32 EFA interfaces, or none) warns. A port that is not ACTIVE is hardware and drains either way.
"""

from __future__ import annotations

import re

from gpuguard.checks._util import fail, incomplete, ok, skip, spec_of
from gpuguard.checks.inventory import count_finding, efa_devices, had_count, ib_devices
from gpuguard.checks.spec import CheckInput
from gpuguard.model import Action, Finding, Observations, RdmaDevice

_REMEDIATE_EFA = ("check `fi_info -p efa` and `ls /sys/class/infiniband`; the EFA driver or a device failed: "
                  "reboot (a stop/start moves the instance to new hardware), replace if it persists")
_REMEDIATE_IB = "check `ibstat` / `ibv_devinfo`, cables and the switch port; reboot, reseat or replace the HCA"


def _down_ports(devs: list[RdmaDevice]) -> list[str]:
    return [f"{d.name}/{p.port}:{p.state or '?'}" for d in devs for p in d.ports if (p.state or "").upper() != "ACTIVE"]


def check_efa(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    expected = inp.profile.efa_devices
    if not expected:
        return [skip(s, "profile expects no EFA devices")]
    fab = obs.fabric
    if fab is None:
        return [incomplete(s, "fabric not read")]
    efa = efa_devices(fab)
    findings: list[Finding] = []
    # A device that is gone: a failed card, drained for an admin (a reboot cannot attach an interface, and a
    # reboot action would escalate to "replace" after two). Fewer on a node that never had more: a launch choice.
    count = count_finding(s, "EFA devices", len(efa), expected, had_count(obs, "efa"), _REMEDIATE_EFA,
                          Action.DRAIN, devices=[d.name for d in efa]) if fab.devices_read else None
    if count:
        findings.append(count)
    down = _down_ports(efa)
    if down:
        findings.append(fail(s, f"EFA port not ACTIVE: {', '.join(down[:4])}"
                             + (f" +{len(down) - 4} more" if len(down) > 4 else ""), _REMEDIATE_EFA,
                             Action.REBOOT, down=down))
    if efa and inp.profile.libfabric_provider and inp.params.get("check_provider", True):
        fi = fab.fi_info
        if fi is None or not fi.ran:
            findings.append(incomplete(s, f"fi_info did not run: {fi.error if fi else 'not configured'}"))
        elif not fi.provider_found:
            # software on the node (libfabric / the EFA installer), not hardware: drain, never reboot-escalate
            findings.append(fail(s, f"libfabric provider {inp.profile.libfabric_provider} not available",
                                 _REMEDIATE_EFA, Action.DRAIN, error=fi.error))
        elif fi.devices < len(efa):
            findings.append(fail(s, f"libfabric sees {fi.devices} of the {len(efa)} EFA devices in sysfs",
                                 _REMEDIATE_EFA, Action.DRAIN, fi_info_devices=fi.devices, sysfs_devices=len(efa)))
    if not fab.devices_read and not findings:
        findings.append(incomplete(s, f"fabric probe incomplete: {fab.status.error}"))
    return findings or [ok(s, f"{len(efa)} EFA devices, ports ACTIVE, provider ok", devices=len(efa))]


def _rate_gbps(rate: str | None) -> float | None:
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
    return float(m.group(1)) if m else None


def check_ib(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    expected = inp.profile.ib_devices
    if not expected:
        return [skip(s, "profile expects no InfiniBand devices")]
    fab = obs.fabric
    if fab is None:
        return [incomplete(s, "fabric not read")]
    names = inp.profile.ib_compute_devices
    ib = ib_devices(fab, inp.profile)
    findings: list[Finding] = []
    missing = sorted(set(names) - {d.name for d in ib}) if names else []
    count = count_finding(s, "InfiniBand HCAs" + (f" (missing {','.join(missing[:4])})" if missing else ""), len(ib),
                          expected, had_count(obs, "ib"), _REMEDIATE_IB, Action.DRAIN,
                          devices=[d.name for d in ib]) if fab.devices_read else None
    if count:
        findings.append(count)
    down = _down_ports(ib)
    if down:
        findings.append(fail(s, f"IB port not ACTIVE: {', '.join(down[:4])}"
                             + (f" +{len(down) - 4} more" if len(down) > 4 else ""), _REMEDIATE_IB,
                             Action.DRAIN, down=down))
    want = inp.profile.ib_rate_gbps
    if want:
        slow = [f"{d.name}/{p.port}:{p.rate}" for d in ib for p in d.ports
                if (p.state or "").upper() == "ACTIVE" and (_rate_gbps(p.rate) or 0) < want]
        if slow:
            findings.append(fail(s, f"IB link below {want} Gb/s: {', '.join(slow[:3])}", _REMEDIATE_IB,
                                 Action.DRAIN, slow=slow))
    if not fab.devices_read and not findings:
        findings.append(incomplete(s, f"fabric probe incomplete: {fab.status.error}"))
    return findings or [ok(s, f"{len(ib)} InfiniBand HCAs ACTIVE")]
