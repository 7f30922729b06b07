"""Temperature and clocks: gpu.temperature, gpu.throttle (the job's GPUs; not judged right after a job)."""

from __future__ import annotations

from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.checks._util import (fail, gpu_label, job_gpus, nvml_unavailable, ok, skip, spec_of, unread_fields,
                                   unread_finding, warn)
from gpuguard.model import Action, Finding, GpuInfo, Observations

_COOLING = "check cooling: fans, airflow, blocked inlets, data-centre temperature"


def check_temperature(obs: Observations, inp: CheckInput) -> list[Finding]:
    """GPU and HBM temperature against the GPU's own limits as NVML reports them (slowdown threshold, max
    operating temperature, HBM max), which differ per model and board; the profile's numbers are only a
    fallback for a GPU that reports none, and a site's `fail_c`/`warn_c` can only make them stricter."""
    s = spec_of(inp)
    bad = nvml_unavailable(s, obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    findings: list[Finding] = []
    judged = False
    for g in job_gpus(obs.nvml, inp.job_gpus):
        unread = unread_fields(g, [("temperature_c", "temperature")], obs.nvml.gpus)
        if unread:
            findings.append(unread_finding(s, g, unread))
            continue
        gpu_findings, gpu_judged = _judge_gpu_temperature(s, g, inp)
        findings += gpu_findings
        judged = judged or gpu_judged
    if not findings and not judged:
        return [skip(s, "no temperature limit from NVML, the profile or the config")]
    return findings or [ok(s, "GPU and HBM temperatures within the GPUs' own limits")]


def _judge_gpu_temperature(s: CheckSpec, g: GpuInfo, inp: CheckInput) -> tuple[list[Finding], bool]:
    site_warn, site_fail = inp.params.get("warn_c"), inp.params.get("fail_c")
    findings: list[Finding] = []
    judged = False
    t = g.temperature_c
    if t is not None:
        own = g.temperature_slowdown_c
        fail_c = own if own else inp.profile.gpu_temp_fail_c
        if site_fail:
            fail_c = min(fail_c, site_fail) if fail_c else site_fail
        limits = [x for x in (g.temperature_gpu_max_c, inp.profile.gpu_temp_warn_c, site_warn, fail_c) if x]
        warn_c = min(limits) if limits else None
        judged = bool(fail_c or warn_c)
        source = "the GPU's slowdown temperature" if own and fail_c == own else "configured"
        if fail_c and t >= fail_c:
            findings.append(fail(s, f"{gpu_label(g)} at {t}C (limit {fail_c}C, {source})", _COOLING, Action.DRAIN,
                                 gpu=g.index, temperature_c=t, limit_c=fail_c, gpu_max_c=g.temperature_gpu_max_c))
        elif warn_c and t >= warn_c:
            findings.append(warn(s, f"{gpu_label(g)} at {t}C (warn {warn_c}C)", "watch cooling for this node",
                                 gpu=g.index, temperature_c=t, gpu_max_c=g.temperature_gpu_max_c))
    m, mem_max = g.memory_temperature_c, g.temperature_mem_max_c
    if m is not None and mem_max:
        judged = True
        if m >= mem_max:
            findings.append(fail(s, f"{gpu_label(g)} HBM at {m}C (its max operating {mem_max}C)",
                                 "memory overheating: check cooling; HBM above its limit corrupts data",
                                 Action.DRAIN, gpu=g.index, memory_temperature_c=m, limit_c=mem_max))
        elif m >= mem_max - inp.params.get("hbm_margin_c", 5):
            findings.append(warn(s, f"{gpu_label(g)} HBM at {m}C (max {mem_max}C)", "watch cooling for this node",
                                 gpu=g.index, memory_temperature_c=m))
    return findings, judged


# nvmlClocksEventReason* bits (nvml.h)
THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}


def decode_throttle(mask: int) -> list[str]:
    return [name for name, bit in THROTTLE_BITS.items() if mask & bit]


def check_throttle(obs: Observations, inp: CheckInput) -> list[Finding]:
    """Hardware clock slowdown. One sample proves little (a power-brake pulse, a transient thermal event), so a
    failure carries a persistence requirement (`persist_s`): the runner drains only when the same GPU showed the
    same reasons in every run for that long (gpud likewise waits minutes), and warns until then."""
    s = spec_of(inp)
    bad = nvml_unavailable(s, obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    fail_bits = {n for n in inp.params.get("fail_reasons", []) if n in THROTTLE_BITS}
    warn_bits = {n for n in inp.params.get("warn_reasons", []) if n in THROTTLE_BITS}
    findings: list[Finding] = []
    for g in job_gpus(obs.nvml, inp.job_gpus):
        unread = unread_fields(g, [("clock_event_reasons", "clock_event_reasons")], obs.nvml.gpus)
        if unread:
            findings.append(unread_finding(s, g, unread))
            continue
        if g.clock_event_reasons is None:
            continue
        active = decode_throttle(g.clock_event_reasons)
        hard = [r for r in active if r in fail_bits]
        soft = [r for r in active if r in warn_bits]
        if hard:
            findings.append(fail(s, f"{gpu_label(g)} clocks throttled: {','.join(hard)}",
                                 "hardware slowdown: check cooling, power supplies and the power brake signal; "
                                 "reboot, replace if it persists", Action.DRAIN, gpu=g.index, reasons=active,
                                 mask=hex(g.clock_event_reasons),
                                 persist={"key": f"{g.uuid or g.index}:{','.join(sorted(hard))}",
                                          "seconds": inp.params.get("persist_s", 240)}))
        elif soft:
            findings.append(warn(s, f"{gpu_label(g)} clocks throttled: {','.join(soft)}", "check cooling",
                                 gpu=g.index, reasons=active))
    return findings or [ok(s, "no hardware clock throttling")]
