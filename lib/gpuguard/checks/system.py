"""Host checks: memory, disk space, CPUs."""

from __future__ import annotations

from gpuguard.checks import CheckInput
from gpuguard.checks._util import fail, incomplete, mismatch, ok, skip
from gpuguard.model import Action, Finding, Observations, SystemObservation


def _sys(obs: Observations, cid: str, keyword: str) -> SystemObservation | Finding:
    if obs.system is None:
        return incomplete(cid, keyword, "system resources not read")
    return obs.system


def check_memory(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "sys.memory"
    want_total = inp.profile.memory_gib
    min_avail = inp.params.get("min_available_gib")
    if not want_total and min_avail is None:
        return [skip(cid, "no memory_gib in profile and no min_available_gib configured")]
    s = _sys(obs, cid, "MEM")
    if isinstance(s, Finding):
        return [s]
    if s.mem_total_mib is None:
        return [incomplete(cid, "MEM", f"memory not readable: {s.status.error}")]
    findings: list[Finding] = []
    total_gib = s.mem_total_mib / 1024
    # memory_gib is a floor for MemTotal (profiles set it ~5% under nominal: firmware/kernel reservations).
    if want_total and total_gib < want_total:
        # Less memory than the profile: a failed DIMM, or a profile that does not fit this node type / a kernel
        # reservation. Applied fleet-wide, the second would drain everything: warn unless the site says fail.
        findings.append(mismatch(cid, "MEM", f"{total_gib:.0f} GiB memory installed, expected {want_total} GiB",
                                 "a DIMM is missing or failed (`dmidecode -t memory`, the BMC log), or the profile "
                                 "does not fit this node (node.overrides.memory_gib)",
                                 inp.params.get("total_severity", "warn"), total_gib=round(total_gib, 1)))
    if min_avail is not None and s.mem_available_mib is not None and s.mem_available_mib / 1024 < min_avail:
        findings.append(fail(cid, "MEM", f"only {s.mem_available_mib / 1024:.1f} GiB memory available, "
                             f"need {min_avail:g} GiB",
                             "leftover processes or a full tmpfs hold memory: find them (`ps aux --sort=-rss`, "
                             "`df -h /dev/shm`) and clean up", Action.DRAIN,
                             available_gib=round(s.mem_available_mib / 1024, 1)))
    return findings or [ok(cid, f"{total_gib:.0f} GiB installed, "
                            f"{(s.mem_available_mib or 0) / 1024:.0f} GiB available")]


def check_disk(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "sys.disk"
    paths = inp.params.get("paths") or []
    if not paths:
        return [skip(cid, "no disk paths configured")]
    s = _sys(obs, cid, "DISK")
    if isinstance(s, Finding):
        return [s]
    usage = {d.path: d for d in s.disks}
    findings: list[Finding] = []
    for item in paths:
        d = usage.get(item["path"])
        if d is None or d.free_mib is None:
            findings.append(fail(cid, "DISK", f"{item['path']} not usable: {d.error if d else 'not read'}",
                                 "the path is missing or its filesystem is not mounted/hung", Action.DRAIN,
                                 path=item["path"]))
            continue
        free_gib = d.free_mib / 1024
        if free_gib < item["min_free_gib"]:
            findings.append(fail(cid, "DISK", f"{item['path']} has {free_gib:.1f} GiB free, need {item['min_free_gib']:g}",
                                 f"free space on {item['path']} (old job files, core dumps, container layers)",
                                 Action.DRAIN, path=item["path"], free_gib=round(free_gib, 2)))
    return findings or [ok(cid, "free space OK on " + ", ".join(p["path"] for p in paths))]


def check_cpu(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "sys.cpu"
    want = inp.profile.cpus
    if not want:
        return [skip(cid, "profile sets no cpus")]
    s = _sys(obs, cid, "CPU")
    if isinstance(s, Finding):
        return [s]
    if s.cpus_online is None:
        return [incomplete(cid, "CPU", "online CPUs not readable")]
    smt_off = s.smt_active is False or s.smt_control in ("off", "forceoff", "notsupported", "notimplemented")
    if s.cpus_online == want:
        return [ok(cid, f"{s.cpus_online} CPUs online")]
    if smt_off and s.cpus_online * 2 == want:
        # one thread per core: SMT disabled in BIOS / `nosmt`, or EC2 CpuOptions ThreadsPerCore=1
        return [ok(cid, f"{s.cpus_online} CPUs online: {want // 2} cores, one thread per core (SMT "
                        f"{s.smt_control or 'off'})", online=s.cpus_online, smt=s.smt_control)]
    offline = f"; offline: {s.cpus_offline}" if s.cpus_offline else ""
    return [mismatch(cid, "CPU", f"{s.cpus_online} CPUs online, expected {want}"
                     + (f" ({want // 2} with SMT off)" if want % 2 == 0 else "") + offline,
                     "if CPUs were taken offline (`lscpu`, /sys/devices/system/cpu/offline) bring them back or "
                     "reboot; if this node type has a different count, fix the profile (node.overrides.cpus)",
                     inp.params.get("severity", "warn"), online=s.cpus_online, expected=want,
                     smt=s.smt_control, offline=s.cpus_offline or "")]
