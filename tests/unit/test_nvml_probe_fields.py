"""The NVML fields gpuguard added for issue 9, read through the real nvidia-ml-py binding over the fake library,
with values taken from a real H100 SXM (tests/fixtures/nvml/h100_sxm_580_idle_and_load.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.probes.nvml import read_nvml
from gpuguard.simulate.build import build_fake_nvml

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "h100_sxm_580_idle_and_load.jsonl"
REAL = json.loads(FIXTURE.read_text().splitlines()[0])["gpus"][0]


def _gpu(i: int, **extra: object) -> str:
    r = REAL
    lines = {
        "name": r["name"], "uuid": f"GPU-82193ff9-1ab1-725b-2261-60b4414f517{i}", "serial": r["serial"],
        "pci_bus_id": f"00000000:{0x53 + 0x11 * i:02X}:00.0", "minor": r["minor"] + i,
        "memory_total": r["mem_info_total"], "temperature": r["temp"], "temp_slowdown": r["thr_SLOWDOWN"],
        "temp_shutdown": r["thr_SHUTDOWN"], "temp_gpu_max": r["thr_GPU_MAX"], "temp_mem_max": r["thr_MEM_MAX"],
        "temp_memory": r["fi_MEMORY_TEMP"], "pcie.replay": r["pcie_replay"], "persistence_mode": r["persistence"],
        "mig_current": r["mig_mode"][0], "mig_pending": r["mig_mode"][1], "recovery_action": r["fi_RECOVERY_ACTION"],
        "fabric.state": r["fabric_v3"]["state"], "fabric.status": r["fabric_v3"]["status"],
        "clocks_event_reasons": r["clock_reasons"],
    }
    lines.update({k: v for k, v in extra.items()})
    return "".join(f"gpu.{i}.{k}={v}\n" for k, v in lines.items())


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_fake_nvml(tmp_path_factory.getbasetemp() / "fakenvml"))


def _read(lib: str, tmp_path: Path, text: str):
    path = tmp_path / "nvml.txt"
    path.write_text("driver_version=580.159.04\n" + text)
    return read_nvml(library_path=lib, env={"GPUGUARD_FAKE_NVML_FILE": str(path)})


def test_real_h100_values_come_through(lib: str, tmp_path: Path) -> None:
    obs = _read(lib, tmp_path, _gpu(0))
    g = obs.gpus[0]
    assert obs.status.complete and not g.errors, g.errors
    assert (g.temperature_shutdown_c, g.temperature_slowdown_c, g.temperature_mem_max_c, g.temperature_gpu_max_c) \
        == (95, 89, 95, 87)
    assert g.memory_temperature_c == 36 and g.pcie_replay_counter == 0 and g.minor_number == 0
    assert g.persistence_mode is True and g.mig_enabled is False and g.mig_devices == []
    assert (g.fabric_state, g.fabric_status) == (0, 0)  # NOT_SUPPORTED: a single GPU with no NVSwitch
    assert obs.init_duration_s is not None and obs.init_duration_s < 1.0


def test_mig_devices_and_fabric_registration(lib: str, tmp_path: Path) -> None:
    text = _gpu(0, mig_current=1, mig_pending=1, **{"mig.0": "MIG-11111111-2222-3333-4444-555555555555",
                                                     "mig.3": "MIG-aaaaaaaa-2222-3333-4444-555555555555",
                                                     "fabric.state": 3, "fabric.status": 0,
                                                     "fabric.health_mask": 0x10A})
    obs = _read(lib, tmp_path, text + _gpu(1, minor=7))
    g0, g1 = obs.gpus
    assert g0.mig_enabled is True
    assert g0.mig_devices == ["MIG-11111111-2222-3333-4444-555555555555", "MIG-aaaaaaaa-2222-3333-4444-555555555555"]
    assert (g0.fabric_state, g0.fabric_status, g0.fabric_health_mask) == (3, 0, 0x10A)
    assert g1.minor_number == 7 and g1.mig_devices == []


def test_older_driver_without_fabric_or_mig(lib: str, tmp_path: Path) -> None:
    text = "".join(line + "\n" for line in _gpu(0).splitlines()
                   if not line.split("=")[0].endswith(("fabric.state", "fabric.status", "mig_current", "mig_pending")))
    g = _read(lib, tmp_path, text).gpus[0]
    assert g.fabric_state is None and g.mig_enabled is None and not g.errors
