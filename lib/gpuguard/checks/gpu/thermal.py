"""Temperature and clocks: gpu.temperature, gpu.throttle (the job's GPUs; not judged right after a job)."""

from __future__ import annotations

from typing import Optional

from gpuguard.checks._util import fail, gpu_label, nvml_gpus, ok, skip, spec_of, warn
from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.model import Action, Finding, GpuInfo, Observations

_COOLING = "check cooling: fans, airflow, blocked inlets, data-centre temperature"


def check_temperature(obs: Observations, inp: CheckInput) -> list[Finding]:
    """GPU and HBM temperature against the GPU's own limits as NVML reports them (slowdown threshold, max
    operating temperature, HBM max), which differ per model and board; the profile's numbers are only a
    fallback for a GPU that reports none, and a site's `fail_c`/`warn_c` can only make them stricter."""
    s = spec_of(inp)
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    findings, judged = nv.judge_each([("temperature_c", "temperature")], lambda g: _judge_gpu_temperature(s, g, inp))
    if not findings and not judged:
        return [skip(s, "no temperature limit from NVML, the profile or the config")]
    return findings or [ok(s, "GPU and HBM temperatures within the GPUs' own limits")]


def _judge_gpu_temperature(s: CheckSpec, g: GpuInfo, inp: CheckInput) -> Optional[list[Finding]]:
    """None when no limit applies to this GPU (not judged)."""
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
    return findings if judged else None


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
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    fail_bits = {n for n in inp.params.get("fail_reasons", []) if n in THROTTLE_BITS}
    warn_bits = {n for n in inp.params.get("warn_reasons", []) if n in THROTTLE_BITS}
    persist_s = inp.params.get("persist_s", 240)
    findings, _ = nv.judge_each([("clock_event_reasons", "clock_event_reasons")],
                                lambda g: _throttle_faults(s, g, fail_bits, warn_bits, persist_s))
    return findings or [ok(s, "no hardware clock throttling")]


def _throttle_faults(s: CheckSpec, g: GpuInfo, fail_bits: set[str], warn_bits: set[str],
                     persist_s: float) -> Optional[list[Finding]]:
    if g.clock_event_reasons is None:
        return None
    active = decode_throttle(g.clock_event_reasons)
    hard = [r for r in active if r in fail_bits]
    soft = [r for r in active if r in warn_bits]
    if hard:
        return [fail(s, f"{gpu_label(g)} clocks throttled: {','.join(hard)}",
                     "hardware slowdown: check cooling, power supplies and the power brake signal; "
                     "reboot, replace if it persists", Action.DRAIN, gpu=g.index, reasons=active,
                     mask=hex(g.clock_event_reasons),
                     persist={"key": f"{g.uuid or g.index}:{','.join(sorted(hard))}", "seconds": persist_s})]
    if soft:
        return [warn(s, f"{gpu_label(g)} clocks throttled: {','.join(soft)}", "check cooling", gpu=g.index,
                     reasons=active)]
    return []
