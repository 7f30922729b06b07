"""GPU links: gpu.pcie (trained link under load, replay rate), gpu.nvlink, gpu.fabric (NVSwitch registration).

Link counts and trained widths below the profile are judged against the node's own history
(gpuguard.checks.inventory): a link this GPU had and lost fails, a property the platform never had warns.
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.checks._util import fail, gpu_label, incomplete, mismatch, nvml_gpus, ok, skip, spec_of, warn
from gpuguard.checks.inventory import GPU_IDLE, count_finding, gpu_busy, had_nvlinks, had_pcie
from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.model import Action, Finding, GpuInfo, Observations

__all__ = ["GPU_IDLE", "gpu_busy", "check_pcie", "check_nvlink", "check_fabric", "decode_fabric_health",
           "FABRIC_STATES"]

_PCIE_REBOOT = "degraded PCIe link: reboot to retrain it; if it persists reseat the GPU/riser or replace"


def check_pcie(obs: Observations, inp: CheckInput) -> list[Finding]:
    """The trained PCIe link, judged only under load (current generation and width), and its error rate (replays
    per minute between two runs; DCGM's limit is 8/min, "the maximum recommended by RM"). An idle reading is
    reported, never drained on. Under load below the profile: a fault when this GPU trained higher under load
    before (the node's inventory), else a warning (the platform's norm). NVML's "max" generation is the most the
    device *and the system* allow, a capability: below the profile it is a BIOS/slot setting, which warns."""
    s = spec_of(inp)
    gen, width = inp.profile.pcie_gen, inp.profile.pcie_width
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    p = inp.params
    findings: list[Finding] = []
    idle_low: list[str] = []
    for g in nv.gpus:
        unread = nv.unread(g, [("pcie_gen_current", "pcie_gen_current"),
                               ("pcie_width_current", "pcie_width_current")]) if gen or width else None
        if unread:
            findings.append(unread)
        low = _below_profile(g, gen, width)
        if low and gpu_busy(g, p.get("busy_util_pct", 5.0)):
            findings.append(_low_under_load(s, g, low, gen, width, had_pcie(obs, g)))
        elif low:
            idle_low.append(f"GPU {g.index} {' '.join(low)}")
        if gen and g.pcie_gen_max is not None and g.pcie_gen_max < gen:
            findings.append(mismatch(s, f"{gpu_label(g)} PCIe link can train at most Gen{g.pcie_gen_max} in this "
                                     f"system, expected Gen{gen}",
                                     "a BIOS or slot setting limits the link (NVML's max generation is what device "
                                     "and system allow): check the BIOS PCIe settings",
                                     p.get("capability_severity", "warn"), gpu=g.index, gen_max=g.pcie_gen_max,
                                     expected_gen=gen))
        replay = _replay_rate(s, g, obs, p)
        if replay:
            findings.append(replay)
    if not findings:
        if not (gen or width) and not any(g.pcie_replay_counter for g in nv.peers):
            return [skip(s, "profile sets no pcie_gen/pcie_width")]
        busy = [g.index for g in nv.gpus if gpu_busy(g, p.get("busy_util_pct", 5.0))]
        idle = f"; idle readings not judged: {', '.join(idle_low[:8])}" if idle_low else ""
        return [ok(s, f"PCIe links at the expected width and generation ({len(busy)} GPU(s) under load), "
                      f"replay rate normal{idle}", idle_low=idle_low, busy=busy)]
    return findings


def _below_profile(g: GpuInfo, gen: Optional[int], width: Optional[int]) -> list[str]:
    low = []
    if width and g.pcie_width_current is not None and g.pcie_width_current < width:
        low.append(f"x{g.pcie_width_current} (expected x{width})")
    if gen and g.pcie_gen_current is not None and g.pcie_gen_current < gen:
        low.append(f"Gen{g.pcie_gen_current} (expected Gen{gen})")
    return low


def _low_under_load(s: CheckSpec, g: GpuInfo, low: list[str], gen: Optional[int], width: Optional[int],
                    had: Optional[tuple[int, int]]) -> Finding:
    cur_g, cur_w = g.pcie_gen_current, g.pcie_width_current
    ev = dict(gpu=g.index, width=cur_w, gen=cur_g, expected_width=width, expected_gen=gen,
              utilization_pct=g.utilization_gpu_pct, had=list(had) if had else None)
    what = f"{gpu_label(g)} PCIe link at {' '.join(low)} under load ({g.utilization_gpu_pct}% busy)"
    if had and ((cur_g is not None and cur_g < had[0]) or (cur_w is not None and cur_w < had[1])):
        return fail(s, f"{what}; it trained at Gen{had[0]} x{had[1]} under load before", _PCIE_REBOOT,
                    Action.REBOOT, **ev)
    return warn(s, f"{what}; never trained higher under load on this node (a platform or slot limit?)",
                "compare with other nodes of this type; if they train higher, reseat the GPU/riser or check the BIOS "
                "PCIe settings", launch_choice=True, first_seen=had is None, **ev)


def _replay_rate(s: CheckSpec, g: GpuInfo, obs: Observations, p: Any) -> Optional[Finding]:
    previous = (obs.previous or {}).get("pcie_replay") or {}
    before = previous.get(g.uuid or str(g.index))
    if g.pcie_replay_counter is None or not (isinstance(before, list) and len(before) == 2) or not obs.now:
        return None
    minutes = (obs.now - float(before[1])) / 60.0
    delta = g.pcie_replay_counter - int(before[0])
    if minutes < 1.0 or delta <= 0:
        return None
    rate = delta / minutes
    rate_warn, rate_fail = p.get("replay_rate_warn_per_min", 8.0), p.get("replay_rate_fail_per_min")
    ev = {"replays": delta, "minutes": round(minutes, 1), "rate_per_min": round(rate, 1)}
    if rate_fail is not None and rate > rate_fail:
        return fail(s, f"{gpu_label(g)} {rate:.0f} PCIe replays/min (limit {rate_fail:g})",
                    "a marginal PCIe link (signal integrity): reseat the GPU/riser; replace if it persists",
                    Action.REBOOT, gpu=g.index, **ev)
    if rate_warn is not None and rate > rate_warn:
        return warn(s, f"{gpu_label(g)} {rate:.0f} PCIe replays/min over {minutes:.0f} min (DCGM limit "
                    f"{rate_warn:g}/min)", "a marginal PCIe link: watch it; reseat the GPU/riser at the next "
                    "maintenance", gpu=g.index, **ev)
    return None


_NVLINK_REMEDY = "check `nvidia-smi nvlink -s` and fabric manager; reset/reboot, replace if it recurs"


def check_nvlink(obs: Observations, inp: CheckInput) -> list[Finding]:
    """Every NVLink the profile expects is active. A link NVML reports down fails (hardware); a state NVML could not
    give is unknown (incomplete, never "no NVLinks"); fewer links than the profile fail only when this GPU had
    them before (the node's inventory), else warn."""
    s = spec_of(inp)
    expected = inp.profile.nvlinks_per_gpu
    if not expected:
        return [skip(s, "profile sets no nvlinks_per_gpu")]
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    findings: list[Finding] = []
    for g in nv.gpus:
        links = g.nvlink_active
        if links is None:
            why = g.errors.get("nvlink") or "NOT_SUPPORTED"
            findings.append(incomplete(s, f"{gpu_label(g)}: NVLink state not read ({why}): not judged",
                                       unsupported=why == "NOT_SUPPORTED", gpu=g.index))
            continue
        down = [i for i, up in enumerate(links[:expected]) if up is False]
        unknown = [i for i, up in enumerate(links[:expected]) if up is None]
        if down:
            findings.append(fail(s, f"{gpu_label(g)} NVLink {','.join(map(str, down))} down "
                                 f"({sum(1 for x in links[:expected] if x)}/{expected} active)", _NVLINK_REMEDY,
                                 Action.REBOOT, gpu=g.index, down=down,
                                 active=sum(1 for x in links[:expected] if x)))
        if unknown:
            why = g.errors.get("nvlink") or "NOT_SUPPORTED"
            findings.append(incomplete(s, f"{gpu_label(g)}: state of NVLink {_links(unknown)} not readable ({why}): "
                                       "not judged", unsupported=why == "NOT_SUPPORTED", gpu=g.index, unknown=unknown))
            continue
        missing = count_finding(s, f"NVLinks on {gpu_label(g)}", len(links), expected, had_nvlinks(obs, g),
                                _NVLINK_REMEDY, Action.REBOOT, gpu=g.index)
        if missing:
            findings.append(missing)
    return findings or [ok(s, f"all {expected} NVLinks active on every GPU")]


def _links(idx: list[int]) -> str:
    return ",".join(map(str, idx[:6])) + (f" +{len(idx) - 6} more" if len(idx) > 6 else "")


# NVML_GPU_FABRIC_STATE_* and the NVML_GPU_FABRIC_HEALTH_MASK_* fields (nvml.h, R550+)
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
_HEALTH_FIELDS = (  # (name, shift, width mask, value that is bad, what it means)
    ("degraded_bw", 0, 0x3, 1, "NVLink bandwidth degraded"),
    ("route_recovery", 2, 0x3, 1, "route recovery in progress"),
    ("route_unhealthy", 4, 0x3, 1, "route unhealthy"),
    ("access_timeout_recovery", 6, 0x3, 1, "access-timeout recovery in progress"),
)
_INCORRECT_CONFIG = {2: "incorrect SysGUID", 3: "incorrect chassis serial", 4: "no partition",
                     5: "insufficient NVLinks", 6: "incompatible GPU firmware", 7: "invalid location",
                     8: "GPU state invalid"}
_FABRIC_REMEDY = ("check Fabric Manager: `systemctl status nvidia-fabricmanager` (same version as the driver), its "
                  "log (/var/log/fabricmanager.log) and `nvidia-smi -q | grep -A3 Fabric`")


def decode_fabric_health(mask: int) -> dict[str, int]:
    """healthMask -> {field: value}; 0 = not supported, 1 = TRUE (bad), 2 = FALSE; incorrect_configuration (4 bits
    at shift 8): 0 not supported, 1 none, 2.. a reason."""
    out = {name: (mask >> shift) & width for name, shift, width, _, _ in _HEALTH_FIELDS}
    out["incorrect_configuration"] = (mask >> 8) & 0xF
    return out


def check_fabric(obs: Observations, inp: CheckInput) -> list[Finding]:
    """NVSwitch systems (HGX H100/H200/B200): Fabric Manager must have registered every GPU in the NVLink fabric,
    or CUDA refuses to start ("system not yet initialized"). NVIDIA's Fabric Manager guide checks it with
    `nvidia-smi -q` (Fabric: State Completed, Status Success), which is nvmlDeviceGetGpuFabricInfo."""
    s = spec_of(inp)
    if not inp.profile.nvswitch:
        return [skip(s, "profile is not an NVSwitch system")]
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    findings, judged = nv.judge_each([("fabric_state", "fabric")], lambda g: _fabric_faults(s, g))
    if not judged:
        return [skip(s, "no GPU reports an NVLink fabric state (driver or GPU without fabric info)")]
    return findings or [ok(s, "every GPU registered in the NVLink fabric (state COMPLETED, status success)")]


def _fabric_faults(s: CheckSpec, g: GpuInfo) -> Optional[list[Finding]]:
    if g.fabric_state is None or g.fabric_state == 0:
        return None  # a GPU/driver that does not report fabric state (A100, older drivers)
    state = g.fabric_state
    name = FABRIC_STATES.get(state, str(state))
    if state == 1:
        return [fail(s, f"{gpu_label(g)}: NVLink fabric NOT_STARTED (Fabric Manager not running?)", _FABRIC_REMEDY,
                     Action.DRAIN, gpu=g.index, state=name)]
    if state == 2:
        return [incomplete(s, f"{gpu_label(g)}: NVLink fabric registration IN_PROGRESS", gpu=g.index, state=name)]
    if g.fabric_status not in (None, 0):
        return [fail(s, f"{gpu_label(g)}: NVLink fabric registration failed (status {g.fabric_status})",
                     _FABRIC_REMEDY + "; reset/reboot; replace if it recurs", Action.REBOOT, gpu=g.index, state=name,
                     status=g.fabric_status)]
    out: list[Finding] = []
    if g.fabric_health_mask:
        health = decode_fabric_health(g.fabric_health_mask)
        bad_fields = [what for name_, _, _, badv, what in _HEALTH_FIELDS if health[name_] == badv]
        conf = health["incorrect_configuration"]
        if conf >= 2:
            out.append(fail(s, f"{gpu_label(g)}: NVLink fabric incorrect configuration: "
                            f"{_INCORRECT_CONFIG.get(conf, conf)}", _FABRIC_REMEDY, Action.DRAIN, gpu=g.index,
                            health=health))
        if bad_fields:
            out.append(fail(s, f"{gpu_label(g)}: {', '.join(bad_fields)}", _FABRIC_REMEDY + "; reset/reboot",
                            Action.REBOOT, gpu=g.index, health=health))
    return out
