"""The epilog's own work between gathering and judging: terminate the job's leftover GPU processes (then look at
the GPUs again) and remove its private node-local scratch."""

from __future__ import annotations

from typing import Any

from gpuguard.checks import CheckSpec
from gpuguard.config.core import EpilogConfig
from gpuguard.config.schema import Config
from gpuguard.context import RunContext
from gpuguard.model import Observations
from gpuguard.pipeline.budget import Deadline
from gpuguard.pipeline.evaluate import name_processes
from gpuguard.pipeline.gather import build_probes, gather
from gpuguard.pipeline.jobscratch import remove_job_scratch
from gpuguard.pipeline.leftovers import cleanup_leftovers
from gpuguard.pipeline.sources import Sources
from gpuguard.profiles import Profile


def epilog_cleanup(ctx: RunContext, cfg: Config, obs: Observations, specs: list[CheckSpec], sources: Sources,
                   profile: Profile, deadline: Deadline, log: Any) -> Any:
    ecfg = cfg.epilog
    grace = min(ecfg.kill_grace_s, deadline.remaining() / 3)
    cleanup = cleanup_leftovers(obs.nvml, ctx.gpu_indices, ctx.job_id, ctx.job_uid, grace, ecfg.kill_leftovers)
    if cleanup.killed:
        nvml_only = [s for s in specs if s.needs == "nvml"]
        again = gather(build_probes(nvml_only, cfg, ctx, sources, profile, None, None), deadline)
        if again.get("nvml") is not None:
            obs.nvml = again["nvml"]
            name_processes(obs, sources.procfs_root)
    _remove_job_scratch(ctx, ecfg, deadline, log)
    return cleanup


def _remove_job_scratch(ctx: RunContext, ecfg: EpilogConfig, deadline: Deadline, log: Any) -> None:
    """The job's private gpuguard-<jobid> scratch under epilog.scratch_dirs, once its processes are gone.
    Owner-checked, never following a link (gpuguard.pipeline.jobscratch); a problem is logged, never fatal."""
    if not (ctx.job_id and ctx.job_uid is not None and ecfg.scratch_dirs):
        return
    try:
        res = remove_job_scratch(ctx.job_id, ctx.job_uid, ecfg.scratch_dirs,
                                 deadline_s=min(5.0, max(0.5, deadline.remaining() / 4)))
        if res.removed or res.skipped or res.errors or res.incomplete:
            log.log("warning" if res.skipped or res.errors or res.incomplete else "info",
                    f"epilog on {ctx.node} job {ctx.job_id}: job scratch: {res.summary()}")
    except Exception:  # noqa: BLE001 - cleaning a cache must never change the epilog's verdict
        pass
