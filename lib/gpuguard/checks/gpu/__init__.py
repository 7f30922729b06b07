"""GPU checks over the NVML observation, by domain. Pure functions: no I/O, no clock, no Slurm.

- identity: gpu.nvml, gpu.count, gpu.model, gpu.memory
- memory_errors: gpu.ecc, gpu.retired_pages, gpu.row_remap, gpu.recovery_action
- thermal: gpu.temperature, gpu.throttle
- links: gpu.pcie, gpu.nvlink, gpu.fabric
- processes: gpu.processes, gpu.leftovers, gpu.memory_released
"""

from gpuguard.checks.gpu.links import FABRIC_STATES, decode_fabric_health, gpu_busy
from gpuguard.checks.gpu.memory_errors import RECOVERY_ACTIONS
from gpuguard.checks.gpu.thermal import THROTTLE_BITS, decode_throttle

__all__ = ["FABRIC_STATES", "RECOVERY_ACTIONS", "THROTTLE_BITS", "decode_fabric_health", "decode_throttle", "gpu_busy"]
