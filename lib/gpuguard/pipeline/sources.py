"""Where a run reads the node from: every path and tool is a parameter (DESIGN §1), so a simulated node is only
other sources. The pipeline never imports the simulator: the entry points hand it the sources
(gpuguard.simulate.sources.resolve_sources picks real or simulated ones from the config)."""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.config.core import SourcesConfig
from gpuguard.util.record import Record, field, record


@record
class Sources(Record):
    kernel_log: str = "auto"
    boot_id_path: str = "/proc/sys/kernel/random/boot_id"
    boot_id: Optional[str] = None
    sysfs_root: str = "/sys"
    procfs_root: str = "/proc"
    fi_info: Optional[str] = "fi_info"
    nvml_library: Optional[str] = None
    nvml_env: dict[str, str] = field(default_factory=dict)
    simulated: Optional[str] = None  # scenario path when simulating
    tools: dict[str, str] = field(default_factory=dict)  # tool name -> path overriding the config (all_reduce_perf, dcgmi)
    profile: Any = None  # the simulated node's profile (a scenario names its instance type)


def real_sources(src: SourcesConfig) -> Sources:
    """The node's own sources from the `sources:` config section."""
    return Sources(kernel_log=src.kernel_log, boot_id_path=src.boot_id_path, sysfs_root=src.sysfs_root,
                   procfs_root=src.procfs_root, fi_info=src.fi_info, nvml_library=src.nvml_library)


def read_boot_id(sources: Sources) -> Optional[str]:
    if sources.boot_id:
        return sources.boot_id
    try:
        with open(sources.boot_id_path) as f:
            return f.read().strip()
    except OSError:
        return None
