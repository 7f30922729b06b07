"""Host checks: sys.memory, sys.disk (free space), sys.cpu."""

from __future__ import annotations

from gpuguard.checks._util import fail, incomplete, mismatch, ok, skip, spec_of, warn
from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.model import Action, DiskUsage, Finding, Observations, SystemObservation


def _sys(obs: Observations, s: CheckSpec) -> SystemObservation | Finding:
    if obs.system is None:
        return incomplete(s, "system resources not read")
    return obs.system


def check_memory(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    want_total = inp.profile.memory_gib
    min_avail = inp.params.get("min_available_gib")
    if not want_total and min_avail is None:
        return [skip(s, "no memory_gib in profile and no min_available_gib configured")]
    sysobs = _sys(obs, s)
    if isinstance(sysobs, Finding):
        return [sysobs]
    if sysobs.mem_total_mib is None:
        return [incomplete(s, f"memory not readable: {sysobs.status.error}")]
    findings: list[Finding] = []
    total_gib = sysobs.mem_total_mib / 1024
    # memory_gib is a floor for MemTotal (profiles set it ~5% under nominal: firmware/kernel reservations).
    if want_total and total_gib < want_total:
        # Less memory than the profile: a failed DIMM, or a profile that does not fit this node type / a kernel
        # reservation. Applied fleet-wide, the second would drain everything: warn unless the site says fail.
        findings.append(mismatch(s, f"{total_gib:.0f} GiB memory installed, expected {want_total} GiB",
                                 "a DIMM is missing or failed (`dmidecode -t memory`, the BMC log), or the profile "
                                 "does not fit this node (node.overrides.memory_gib)",
                                 inp.params.get("total_severity", "warn"), total_gib=round(total_gib, 1)))
    if min_avail is not None and sysobs.mem_available_mib is not None and sysobs.mem_available_mib / 1024 < min_avail:
        findings.append(fail(s, f"only {sysobs.mem_available_mib / 1024:.1f} GiB memory available, "
                             f"need {min_avail:g} GiB",
                             "leftover processes or a full tmpfs hold memory: find them (`ps aux --sort=-rss`, "
                             "`df -h /dev/shm`) and clean up", Action.DRAIN,
                             available_gib=round(sysobs.mem_available_mib / 1024, 1)))
    return findings or [ok(s, f"{total_gib:.0f} GiB installed, "
                           f"{(sysobs.mem_available_mib or 0) / 1024:.0f} GiB available")]


def check_disk(obs: Observations, inp: CheckInput) -> list[Finding]:
    """Free space on the configured paths. A full filesystem that users can write (/tmp, or any filesystem a
    user-writable directory lives on) would let any user drain the node their job ran on: it warns. Only a path the
    site marks `root_owned: true` drains, and only while the probe sees it root-owned and not world-writable."""
    s = spec_of(inp)
    paths = inp.params.get("paths") or []
    if not paths:
        return [skip(s, "no disk paths configured")]
    sysobs = _sys(obs, s)
    if isinstance(sysobs, Finding):
        return [sysobs]
    usage = {d.path: d for d in sysobs.disks}
    findings: list[Finding] = []
    for item in paths:
        d = usage.get(item["path"])
        if d is None or d.free_mib is None:
            findings.append(fail(s, f"{item['path']} not usable: {d.error if d else 'not read'}",
                                 "the path is missing or its filesystem is not mounted/hung", Action.DRAIN,
                                 path=item["path"]))
            continue
        free_gib = d.free_mib / 1024
        if free_gib < item["min_free_gib"]:
            findings.append(_low_space(s, item, d, free_gib))
    return findings or [ok(s, "free space OK on " + ", ".join(p["path"] for p in paths))]


def _low_space(s: CheckSpec, item: dict, d: DiskUsage, free_gib: float) -> Finding:  # type: ignore[type-arg]
    path = item["path"]
    msg = f"{path} has {free_gib:.1f} GiB free, need {item['min_free_gib']:g}"
    clean = f"free space on {path} (old job files, core dumps, container layers)"
    ev = {"path": path, "free_gib": round(free_gib, 2), "owner_uid": d.owner_uid, "world_writable": d.world_writable}
    users_can_write = bool(d.world_writable) or (d.owner_uid is not None and d.owner_uid != 0)
    if item.get("root_owned") and not users_can_write:
        return fail(s, msg, clean, Action.DRAIN, **ev)
    if item.get("root_owned"):
        who = "world-writable" if d.world_writable else f"owned by uid {d.owner_uid}"
        return warn(s, f"{msg}; marked root_owned but {who}: users can fill it, so it only warns",
                    f"{clean}; fix the ownership/mode of {path} or drop root_owned from checks.sys.disk",
                    user_writable=True, **ev)
    return warn(s, f"{msg} (users can write here: warns; root_owned paths drain)",
                f"{clean}; a job may have filled it: look at the newest large files", user_writable=True, **ev)


def check_cpu(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    want = inp.profile.cpus
    if not want:
        return [skip(s, "profile sets no cpus")]
    c = _sys(obs, s)
    if isinstance(c, Finding):
        return [c]
    if c.cpus_online is None:
        return [incomplete(s, "online CPUs not readable")]
    smt_off = c.smt_active is False or c.smt_control in ("off", "forceoff", "notsupported", "notimplemented")
    if c.cpus_online == want:
        return [ok(s, f"{c.cpus_online} CPUs online")]
    if smt_off and c.cpus_online * 2 == want:
        # one thread per core: SMT disabled in BIOS / `nosmt`, or EC2 CpuOptions ThreadsPerCore=1
        return [ok(s, f"{c.cpus_online} CPUs online: {want // 2} cores, one thread per core (SMT "
                        f"{c.smt_control or 'off'})", online=c.cpus_online, smt=c.smt_control)]
    offline = f"; offline: {c.cpus_offline}" if c.cpus_offline else ""
    return [mismatch(s, f"{c.cpus_online} CPUs online, expected {want}"
                     + (f" ({want // 2} with SMT off)" if want % 2 == 0 else "") + offline,
                     "if CPUs were taken offline (`lscpu`, /sys/devices/system/cpu/offline) bring them back or "
                     "reboot; if this node type has a different count, fix the profile (node.overrides.cpus)",
                     inp.params.get("severity", "warn"), online=c.cpus_online, expected=want,
                     smt=c.smt_control, offline=c.cpus_offline or "")]
