"""Plan: which checks this run does, on which profile (the expected hardware)."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from gpuguard.checks import CheckSpec, registry
from gpuguard.config.schema import Config
from gpuguard.context import RunContext
from gpuguard.probes.imds_cache import lookup
from gpuguard.profiles import Profile, apply_overrides, load_profile


def state_dir(cfg: Config) -> str:
    return os.path.dirname(cfg.store.path) or "."


def instance_type(cfg: Config) -> Optional[str]:
    """The EC2 instance type (None off EC2): the per-boot cache, and IMDS only when it misses."""
    cache = os.path.join(state_dir(cfg), "instance-type.json")
    hit, itype = lookup(cache, cfg.sources.boot_id_path)
    if hit:
        return itype
    from gpuguard.probes.imds import get_instance_type  # a miss: once per boot, so HTTP is not on every hook's path

    return get_instance_type(cache, timeout_s=cfg.deadlines.imds_s, endpoint=cfg.sources.imds_endpoint,
                             boot_id_path=cfg.sources.boot_id_path)


def resolve_profile(cfg: Config, node: str) -> tuple[Profile, str]:
    """(profile, how it was chosen). `auto` asks EC2 instance metadata once per boot, else `generic`. The
    profile's compiled copy is kept in the state directory (no YAML on the hooks' path)."""
    ncfg = cfg.node
    name = ncfg.profile
    how = "config"
    if name == "auto":
        itype = instance_type(cfg)
        name, how = (itype, "ec2-metadata") if itype else ("generic", "default (not on EC2)")
        try:
            prof = load_profile(name, ncfg.profile_dir, cache_dir=state_dir(cfg))
        except ValueError:
            prof, how = (load_profile("generic", ncfg.profile_dir, cache_dir=state_dir(cfg)),
                         f"generic (no profile for {name})")
    else:
        prof = load_profile(name, ncfg.profile_dir, cache_dir=state_dir(cfg))
    return apply_overrides(prof, ncfg.overrides), how


def plan_checks(cfg: Config, ctx: RunContext, profile: Optional[Profile] = None, store: Any = None,
                boot_id: Optional[str] = None, now: Optional[float] = None) -> list[CheckSpec]:
    """The checks this run does: the run kind's set; an epilog of a job that died by a signal adds the node
    checks (NVLink, PCIe, fabric, ...) because a crash can be the hardware's doing; a prolog (or manual run)
    adds the optional slow tier (NCCL all_reduce, dcgmi diag) when gpuguard.nccl.tier says it is due."""
    kinds = {ctx.kind}
    if ctx.kind == "epilog" and ctx.job_exit_code in cfg.epilog.deep_on_exit_codes:
        kinds.add("epilog_deep")
    if cfg.nccl.tier_enabled and store is not None and profile is not None:
        from gpuguard.nccl.tier import cursor_name, job_is_exclusive, tier_due  # only a site with the tier

        excl = True if ctx.kind == "manual" else job_is_exclusive(ctx.exclusive, ctx.gpu_indices, profile.gpu_count)
        due, _why = tier_due(cfg.nccl, kind=ctx.kind, exclusive=excl, boot_id=boot_id,
                             last=store.get_cursor(cursor_name(ctx.node)), now=now or time.time())
        if due:
            kinds.add("tier")
    return [s for s in registry() if kinds & s.kinds and cfg.check_enabled(s.id)]
