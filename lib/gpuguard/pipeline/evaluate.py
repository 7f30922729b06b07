"""Evaluate: observations -> findings, through the pure checks (gpuguard.checks). No I/O here but reading process
names from /proc for the report."""

from __future__ import annotations

import os
from typing import Any

from gpuguard.checks import CheckInput, CheckSpec, param_defaults, run_check
from gpuguard.config.schema import Config
from gpuguard.context import RunContext
from gpuguard.model import Finding, Observations
from gpuguard.pipeline.gpumap import resolve_job_gpus
from gpuguard.profiles import Profile
from gpuguard.util.record import replace


def evaluate(specs: list[CheckSpec], obs: Observations, cfg: Config, ctx: RunContext, profile: Profile,
             mapping: Any = None) -> list[Finding]:
    catalog = None
    if obs.kernel_log is not None and obs.kernel_log.events and any(s.needs == "kernel_log" for s in specs):
        # only with an Xid to judge: a quiet prolog neither imports nor builds the catalog (~170 entries)
        from gpuguard.xid.catalog import load_catalog

        catalog = load_catalog(overrides=cfg.xid.overrides or None)
    findings: list[Finding] = []
    for spec in specs:
        inp = CheckInput(profile=profile, params=cfg.check_params(spec.id, param_defaults(spec)),
                         job_gpus=None if spec.scope == "node" else ctx.gpu_indices, kind=ctx.kind,
                         xid_catalog=catalog, unmapped_gpus=mapping.unmapped if mapping else (),
                         gpu_map_notes=mapping.notes if mapping else ())
        findings.extend(run_check(spec, obs, inp))
    return findings


def map_job_gpus(ctx: RunContext, obs: Observations, mode: str) -> tuple[RunContext, Any]:
    """The job's GPUs as NVML indices, from Slurm's ids (GRES index = minor number, or GPU-/MIG- UUIDs)."""
    if ctx.gpu_ids is None or obs.nvml is None or not obs.nvml.gpus:
        return ctx, None
    mapping = resolve_job_gpus(ctx.gpu_ids, obs.nvml.gpus, mode)
    return replace(ctx, gpu_indices=mapping.indices), mapping


def name_processes(obs: Observations, procfs_root: str) -> None:
    """Fill process names for GPU processes from /proc (for the report; pids may be gone already)."""
    if obs.nvml is None:
        return
    for g in obs.nvml.gpus:
        for p in g.processes:
            if p.name:
                continue
            try:
                with open(os.path.join(procfs_root, str(p.pid), "comm")) as f:
                    p.name = f.read().strip()[:32]
            except OSError:
                pass


def observations_from(raw: dict[str, Any]) -> Observations:
    return Observations(nvml=raw.get("nvml"), kernel_log=raw.get("kernel_log"), fabric=raw.get("fabric"),
                        system=raw.get("system"), nccl=raw.get("nccl"), dcgm=raw.get("dcgm"),
                        efa_counters=raw.get("efa_counters"))
