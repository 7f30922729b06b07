"""GPU checks over the NVML observation, by domain. Pure functions: no I/O, no clock, no Slurm.

- identity: whether NVML answers and the GPUs are the ones the profile says
- memory_errors: memory errors and what only a reset clears
- thermal: temperature and clocks
- links: PCIe, NVLink, the NVSwitch fabric
- processes: processes and memory on the job's GPUs

Each module's docstring names its checks (tests/unit/test_check_registry.py keeps them in step with the registry).
"""

from gpuguard.checks.gpu.links import FABRIC_STATES, decode_fabric_health, gpu_busy
from gpuguard.checks.gpu.memory_errors import RECOVERY_ACTIONS
from gpuguard.checks.gpu.thermal import THROTTLE_BITS, decode_throttle

__all__ = ["FABRIC_STATES", "RECOVERY_ACTIONS", "THROTTLE_BITS", "decode_fabric_health", "decode_throttle", "gpu_busy"]
