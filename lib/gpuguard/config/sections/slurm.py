"""The `slurm:` section: how gpuguard talks to Slurm."""

from __future__ import annotations

from typing import Optional

from gpuguard.config.fields import Section, choice, key, section, string


@section
class SlurmConfig(Section):
    """`slurm:` the client backend and what the job's GPU ids mean."""

    backend: str = key(choice("auto", "cli", "pyslurm"), "auto")
    scontrol: str = key(string(), "scontrol")
    # slurm.conf for scontrol when the caller's env has no SLURM_CONF
    conf: Optional[str] = key(string(allow_none=True), None)
    # what the integers in SLURM_JOB_GPUS are: "minor" = GRES index = /dev/nvidiaN minor number (gres.conf
    # File=/dev/nvidia[0-7] and AutoDetect=nvml), "nvml_index" = NVML's index (a gres.conf written that way)
    gpu_ids: str = key(choice("minor", "nvml_index"), "minor")
    # sinfo, for the drain-storm guard's census of the partitions; default: beside `scontrol` when that names a path
    # with sinfo in it, else found on PATH like scontrol (a site whose scontrol is a wrapper names it here)
    sinfo: Optional[str] = key(string(allow_none=True), None)
    # a YAML file naming other parts several nodes share (racks, PDUs: kind -> {nodes: {name: hostlist}, checks}):
    # the drain-storm guard blames such a part, not its nodes, when most of them fail one of its checks together;
    # leaf switches come from Slurm's topology (topology.conf) without it (docs: README "Shared components")
    shared_components_file: Optional[str] = key(string(allow_none=True), None)
