"""Sources for a run: the node's own, or a simulated node's when the config (or --simulate) names a scenario.
Called by the entry points (hooks, `gpuguard check`, the watch daemon, the monitor), never by the pipeline."""

from __future__ import annotations

import os
from typing import Any, Optional

from gpuguard.pipeline.sources import Sources, real_sources
from gpuguard.simulate.materialized import SimSources, current, scenario_for_node


def state_dir(cfg: Any) -> str:
    return os.path.dirname(cfg.store.path) or "."


def resolve_sources(cfg: Any, node: str, simulate: Optional[str] = None) -> Sources:
    sim_cfg = cfg.simulation
    if not (simulate or sim_cfg.scenario or sim_cfg.scenario_dir):
        return real_sources(cfg.sources)
    path = simulate or scenario_for_node(sim_cfg.scenario, sim_cfg.scenario_dir, node)
    assert path is not None
    workdir = os.path.join(sim_cfg.workdir or os.path.join(state_dir(cfg), "sim"), node)
    profile_dir = cfg.node.profile_dir
    sim = current(path, workdir, sim_cfg.fake_nvml, profile_dir) or _materialize(path, workdir, sim_cfg.fake_nvml,
                                                                                      profile_dir)
    return Sources(kernel_log=sim.kernel_log, boot_id=sim.boot_id, sysfs_root=sim.sysfs_root,
                   procfs_root=sim.procfs_root, fi_info=sim.fi_info, nvml_library=sim.nvml_library,
                   nvml_env=sim.nvml_env, simulated=sim.scenario, tools=dict(sim_cfg.tools or {}),
                   profile=sim.profile)


def _materialize(path: str, workdir: str, fake_nvml: Optional[str], profile_dir: Optional[str]) -> SimSources:
    # cold path: the scenario is new or changed (YAML, files written); an unchanged one takes `current` above
    from gpuguard.simulate.scenario import materialize

    return materialize(path, workdir, fake_nvml=fake_nvml, profile_dir=profile_dir)
