"""The one healthy H100 of the tests: a p5.48xlarge's H100 80GB HBM3 (SXM5) with the values a real one reports
(tests/fixtures/nvml/: driver 580, persistence mode on, NVML's own temperature limits), in two shapes from the
same numbers:

- `h100(i)`, `node(...)`, `bad_gpu(i, ...)`: idle and healthy as gpuguard's probe reports it (`GpuInfo`), for the
  checks' tests; a test changes what it judges with keyword arguments (`bad_gpu(3, persistence_mode=False)`);
- `h100_gpu(i)`: GPU `i`'s lines of the flat scenario file the fake libnvidia-ml.so.1 reads
  (gpuguard/simulate/fakenvml.c), for the probe's and the fake's tests; its values vary a little per GPU (used
  memory, temperature, corrected ECC counts), so a test sees each GPU read into the right place.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

from gpuguard.model import GpuInfo, NvmlObservation, Observations, ProbeStatus

NAME = "NVIDIA H100 80GB HBM3"
BUSES = ["53", "64", "75", "86", "97", "A8", "B9", "CA"]  # p5.48xlarge
H100_MEMORY = 85520809984  # 81559 MiB, as an H100 80GB HBM3 reports it
MIB = 1 << 20
GIB = 1 << 30
NVLINKS = 18
# NVML's own temperature limits on a real H100 SXM (driver 580): slowdown, shutdown, GPU max operating, HBM max
SLOWDOWN_C, SHUTDOWN_C, GPU_MAX_C, MEM_MAX_C = 89, 95, 87, 95
DRIVER = "550.90.07"


def h100(i: int, **kw) -> GpuInfo:
    """GPU `i`, idle and healthy, as gpuguard's NVML probe reports it; `kw` replaces fields."""
    g = GpuInfo(index=i, uuid=f"GPU-{i}", pci_bus_id=f"0000:{BUSES[i].lower()}:00.0", name=NAME,
                memory_total_mib=H100_MEMORY // MIB, memory_used_mib=0, ecc_enabled=True, ecc_pending_enabled=True,
                ecc_volatile_uncorrected=0, ecc_volatile_corrected=0, ecc_aggregate_uncorrected=0,
                ecc_aggregate_corrected=2, remapped_rows_correctable=0, remapped_rows_uncorrectable=0,
                remapped_rows_pending=False, remapped_rows_failure=False, recovery_action=0, temperature_c=31,
                temperature_slowdown_c=SLOWDOWN_C, temperature_shutdown_c=SHUTDOWN_C,
                temperature_gpu_max_c=GPU_MAX_C, temperature_mem_max_c=MEM_MAX_C, memory_temperature_c=36,
                clock_event_reasons=0x1, utilization_gpu_pct=0, pcie_gen_current=5, pcie_gen_max=5,
                pcie_width_current=16, pcie_width_max=16, nvlink_active=[True] * NVLINKS, persistence_mode=True,
                minor_number=i,
                fabric_state=3, fabric_status=0, fabric_health_mask=0)  # NVSwitch: Fabric Manager COMPLETED
    return replace(g, **kw)


def node(*gpus: GpuInfo, count: Optional[int] = None) -> Observations:
    """A node's NVML observation: the given GPUs, or eight healthy H100s."""
    gl = list(gpus) or [h100(i) for i in range(8)]
    return Observations(nvml=NvmlObservation(status=ProbeStatus(), driver_version=DRIVER,
                                              device_count=len(gl) if count is None else count, gpus=gl))


def bad_gpu(i: int, **kw) -> Observations:
    """Eight healthy H100s but GPU `i`, whose fields `kw` replaces."""
    return node(*[h100(j, **kw) if j == i else h100(j) for j in range(8)])


def h100_fields(i: int) -> dict[str, object]:
    """GPU `i`'s scenario keys (without the `gpu.<i>.` prefix) -> values, in file order."""
    return {
        "name": NAME, "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-ddddeeeeffff",
        "serial": 1650123456789 + i, "pci_bus_id": f"00000000:{BUSES[i]}:00.0", "pci_device_id": "0x233010DE",
        "pci_subsystem_id": "0x16C110DE", "minor": i, "memory_total": H100_MEMORY, "memory_used": i * GIB,
        "ecc_current": 1, "ecc_pending": 1, "ecc.volatile.uncorrected": 0, "ecc.volatile.corrected": i,
        "ecc.aggregate.uncorrected": i // 4, "ecc.aggregate.corrected": 100 + i, "remap.correctable": i,
        "remap.uncorrectable": 0, "remap.pending": 0, "remap.failure": 0, "recovery_action": 0,
        "temperature": 30 + i, "temp_slowdown": SLOWDOWN_C, "temp_shutdown": SHUTDOWN_C, "temp_gpu_max": GPU_MAX_C,
        "temp_mem_max": MEM_MAX_C, "clocks_event_reasons": "0x1", "pcie.gen_current": 5, "pcie.gen_max": 5,
        "pcie.gpu_gen_max": 5, "pcie.width_current": 16, "pcie.width_max": 16, "nvlink_count": NVLINKS,
        "power_usage": 69000 + i, "power_limit": 700000, "utilization.gpu": i, "utilization.memory": 2 * i,
        "clock.sm": 1980, "clock.mem": 2619, "clock.graphics": 1980, "max_clock.sm": 1980, "max_clock.mem": 2619,
        "max_clock.graphics": 1980, "persistence_mode": 1,
    }


def h100_gpu(i: int, leave_out: tuple[str, ...] = (), values: Mapping[str, object] = {}) -> str:
    """GPU `i`'s lines: a key left out reads as NOT_SUPPORTED; `values` replace (or add, at the end) keys."""
    fields = {k: v for k, v in h100_fields(i).items() if k not in leave_out}
    fields.update(values)
    return "".join(f"gpu.{i}.{key}={value}\n" for key, value in fields.items())
