"""Processes on the job's GPUs: gpu.processes (prolog), gpu.leftovers and gpu.memory_released (epilog)."""

from __future__ import annotations

from gpuguard.checks._util import fail, gpu_label, nvml_gpus, ok, skip, spec_of, unread_finding, warn
from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.model import Action, Finding, GpuInfo, GpuProcess, Observations


def check_processes(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    if inp.job_gpus == ():
        return [skip(s, "the job has no GPUs")]
    severity = inp.params.get("severity", "fail")
    findings: list[Finding] = []
    for g in nv.gpus:
        if "processes" in g.errors:  # an empty list NVML could not fill is not "no processes"
            findings.append(unread_finding(s, g, {"processes": g.errors["processes"]}))
            continue
        if not g.processes:
            continue
        desc = ", ".join(f"pid {p.pid}" + (f" {p.name}" if p.name else "")
                         + (f" {p.used_memory_mib} MiB" if p.used_memory_mib is not None else "")
                         for p in g.processes[:3])
        more = f" +{len(g.processes) - 3} more" if len(g.processes) > 3 else ""
        msg = f"{gpu_label(g)} has {len(g.processes)} leftover process(es): {desc}{more}"
        ev = {"pids": [p.pid for p in g.processes]}
        remediation = "a previous job left processes on the GPU: kill them (the epilog should have); check the epilog"
        if severity == "warn":
            findings.append(warn(s, msg, remediation, gpu=g.index, **ev))
        else:
            findings.append(fail(s, msg, remediation, Action.DRAIN, gpu=g.index, **ev))
    return findings or [ok(s, "no processes on the job's GPUs")]


def _procs(ps: list[GpuProcess]) -> str:
    return ", ".join(f"pid {p.pid}" + (f" {p.name}" if p.name else "") for p in ps[:4]) + \
        (f" +{len(ps) - 4} more" if len(ps) > 4 else "")


def check_leftovers(obs: Observations, inp: CheckInput) -> list[Finding]:
    """Epilog: the job's processes left on its GPUs were terminated; a survivor is stuck in the driver
    (the GPU needs a reset/reboot); another user's process on the job's GPU is not ours to kill."""
    s = spec_of(inp)
    c = obs.cleanup
    if c is None:
        return [skip(s, "no cleanup ran")]
    findings: list[Finding] = []
    if c.survivors:
        findings.append(fail(s, f"{len(c.survivors)} process(es) survived SIGKILL on the job's GPUs: "
                             f"{_procs(c.survivors)}",
                             "processes stuck in the driver (D state): the GPU needs a reset, usually a reboot",
                             Action.REBOOT, pids=[p.pid for p in c.survivors]))
    if c.foreign:
        findings.append(fail(s, f"process(es) of another user on the job's GPUs: {_procs(c.foreign)}",
                             "something outside Slurm uses these GPUs: find out what (ps -o user,cmd -p PID)",
                             Action.DRAIN, pids=[p.pid for p in c.foreign]))
    if c.not_killed:
        findings.append(fail(s, f"{len(c.not_killed)} leftover process(es) of the job on its GPUs: "
                             f"{_procs(c.not_killed)}", "kill them (epilog.kill_leftovers is off)", Action.DRAIN,
                             pids=[p.pid for p in c.not_killed]))
    if c.error:
        findings.append(warn(s, f"leftover cleanup incomplete: {c.error}", "check the epilog log"))
    if not findings:
        msg = f"terminated {len(c.killed)} leftover process(es): {_procs(c.killed)}" if c.killed \
            else "no leftover processes on the job's GPUs"
        findings.append(ok(s, msg, killed=[p.pid for p in c.killed]))
    return findings


def check_memory_released(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    if inp.job_gpus == ():
        return [skip(s, "the job had no GPUs")]
    limit = inp.params.get("max_used_mib", 2048)
    findings, _ = nv.judge_each([("memory_used_mib", "memory")], lambda g: _memory_held(s, g, limit))
    return findings or [ok(s, "GPU memory released")]


def _memory_held(s: CheckSpec, g: GpuInfo, limit: int) -> list[Finding]:
    if g.memory_used_mib is None or g.memory_used_mib <= limit or g.processes:
        return []
    return [fail(s, f"{gpu_label(g)} still has {g.memory_used_mib} MiB in use after the job",
                 "GPU memory not released (a zombie context): reset the GPU (nvidia-smi -r) or reboot", Action.RESET,
                 gpu=g.index, used_mib=g.memory_used_mib)]
