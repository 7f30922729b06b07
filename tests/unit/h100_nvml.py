"""A p5.48xlarge's H100 80GB HBM3s in the flat scenario file the fake libnvidia-ml.so.1 reads
(gpuguard/simulate/fakenvml.c): one GPU's lines, less what a test leaves out, with what it sets otherwise.
Values as a real H100 SXM reports them (tests/fixtures/nvml/)."""

from __future__ import annotations

from typing import Mapping

BUSES = ["53", "64", "75", "86", "97", "A8", "B9", "CA"]  # p5.48xlarge
H100_MEMORY = 85520809984  # 81559 MiB, as an H100 80GB HBM3 reports it
MIB = 1 << 20
GIB = 1 << 30


def h100_fields(i: int) -> dict[str, object]:
    """GPU `i`'s scenario keys (without the `gpu.<i>.` prefix) -> values, in file order."""
    return {
        "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-ddddeeeeffff",
        "serial": 1650123456789 + i, "pci_bus_id": f"00000000:{BUSES[i]}:00.0", "pci_device_id": "0x233010DE",
        "pci_subsystem_id": "0x16C110DE", "minor": i, "memory_total": H100_MEMORY, "memory_used": i * GIB,
        "ecc_current": 1, "ecc_pending": 1, "ecc.volatile.uncorrected": 0, "ecc.volatile.corrected": i,
        "ecc.aggregate.uncorrected": i // 4, "ecc.aggregate.corrected": 100 + i, "remap.correctable": i,
        "remap.uncorrectable": 0, "remap.pending": 0, "remap.failure": 0, "recovery_action": 0,
        "temperature": 30 + i, "temp_slowdown": 87, "temp_shutdown": 92, "temp_gpu_max": 85, "temp_mem_max": 95,
        "clocks_event_reasons": "0x1", "pcie.gen_current": 5, "pcie.gen_max": 5, "pcie.gpu_gen_max": 5,
        "pcie.width_current": 16, "pcie.width_max": 16, "nvlink_count": 18, "power_usage": 69000 + i,
        "power_limit": 700000, "utilization.gpu": i, "utilization.memory": 2 * i, "clock.sm": 1980,
        "clock.mem": 2619, "clock.graphics": 1980, "max_clock.sm": 1980, "max_clock.mem": 2619,
        "max_clock.graphics": 1980, "persistence_mode": 1,
    }


def h100_gpu(i: int, leave_out: tuple[str, ...] = (), values: Mapping[str, object] = {}) -> str:
    """GPU `i`'s lines: a key left out reads as NOT_SUPPORTED; `values` replace (or add, at the end) keys."""
    fields = {k: v for k, v in h100_fields(i).items() if k not in leave_out}
    fields.update(values)
    return "".join(f"gpu.{i}.{key}={value}\n" for key, value in fields.items())
