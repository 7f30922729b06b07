"""gpuguard.probes.nvml.read_nvml against the fake libnvidia-ml.so.1 through the real pynvml binding.

Every test passes the same library_path (pynvml keeps one library per process) and changes only the
scenario file, through read_nvml's `env`, between one nvmlInit and the next.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

LIB = Path(__file__).resolve().parents[2] / "lib"
sys.path.insert(0, str(LIB))  # run from a checkout without install

import pynvml  # noqa: E402

from gpuguard.model import GpuInfo, GpuProcess, NvmlObservation  # noqa: E402
from gpuguard.probes.nvml import normalize_pci_bus_id, nvml_error_name, read_nvml  # noqa: E402
from gpuguard.simulate.build import build_fake_nvml  # noqa: E402
import h100  # noqa: E402
from h100 import BUSES, MIB  # noqa: E402

ENV_VAR = "GPUGUARD_FAKE_NVML_FILE"
# The fake's H100 without what this probe reads as NOT_SUPPORTED (GPU/HBM max thresholds, persistence), used
# memory a little off the MiB, and one compute process each.
PROBE_LEAVES_OUT = ("pci_subsystem_id", "temp_gpu_max", "temp_mem_max", "pcie.gpu_gen_max", "power_limit", "clock.sm",
                    "clock.mem", "clock.graphics", "max_clock.sm", "max_clock.mem", "max_clock.graphics",
                    "persistence_mode")


def h100_gpu(i: int) -> str:
    return h100.h100_gpu(i, PROBE_LEAVES_OUT, {"memory_used": i * 1024 * MIB + 12345, "utilization.memory": 0,
                                                    "process.0": f"{1000 + i}:{(512 + i) * MIB + 999}"})


# What NVML answers NOT_SUPPORTED for on these H100s (in query order): no page retirement, no GPU-max / HBM-max
# thresholds, replay counter, persistence or MIG mode in this fake scenario, no fabric state (no NVSwitch).
H100_UNSUPPORTED = ["retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending", "temperature_gpu_max",
                    "temperature_mem_max", "pcie_replay", "persistence", "mig_mode", "fabric"]


def expected_gpu(i: int) -> GpuInfo:
    """What read_nvml must report for h100_gpu(i)."""
    return GpuInfo(
        unsupported=list(H100_UNSUPPORTED),
        index=i,
        uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-ddddeeeeffff",
        pci_bus_id=f"0000:{BUSES[i].lower()}:00.0",
        name="NVIDIA H100 80GB HBM3",
        serial=str(1650123456789 + i),
        memory_total_mib=81559,
        memory_used_mib=i * 1024,
        ecc_enabled=True,
        ecc_pending_enabled=True,
        ecc_volatile_uncorrected=0,
        ecc_volatile_corrected=i,
        ecc_aggregate_uncorrected=i // 4,
        ecc_aggregate_corrected=100 + i,
        retired_pages_sbe=None,  # an H100 does not retire pages: NOT_SUPPORTED
        retired_pages_dbe=None,
        retired_pages_pending=None,
        remapped_rows_correctable=i,
        remapped_rows_uncorrectable=0,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
        recovery_action=0,
        temperature_c=30 + i,
        temperature_slowdown_c=89,
        temperature_shutdown_c=95,
        clock_event_reasons=1,
        pcie_gen_current=5,
        pcie_gen_max=5,
        pcie_width_current=16,
        pcie_width_max=16,
        nvlink_active=[True] * 18,
        power_mw=69000 + i,
        utilization_gpu_pct=i,
        processes=[GpuProcess(pid=1000 + i, used_memory_mib=512 + i)],
        minor_number=i,
    )


def h100_scenario(*extra: str) -> str:
    head = "driver_version=550.90.07\ndevice_count=8\n"
    return head + "".join(h100_gpu(i) for i in range(8)) + "".join(line + "\n" for line in extra)


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Same directory as test_fakenvml.py uses: one library file for the whole pytest process.
    return build_fake_nvml(tmp_path_factory.getbasetemp() / "fakenvml")


ReadFn = Callable[..., NvmlObservation]


@pytest.fixture
def read(fake_lib: Path, tmp_path: Path) -> ReadFn:
    """read(scenario_text, **read_nvml_kwargs) -> NvmlObservation"""
    counter = iter(range(1_000_000))

    def run(text: str, **kwargs) -> NvmlObservation:
        path = tmp_path / f"scenario{next(counter)}.txt"
        path.write_text(text)
        return read_nvml(library_path=str(fake_lib), env={ENV_VAR: str(path)}, **kwargs)

    return run


def assert_session_closed(fake_lib: Path) -> None:
    count = ctypes.c_uint()
    assert ctypes.CDLL(str(fake_lib)).nvmlDeviceGetCount_v2(ctypes.byref(count)) == 1  # UNINITIALIZED


# --------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("raw, normalized", [
    ("00000000:3B:00.0", "0000:3b:00.0"),
    ("0000:3b:00.0", "0000:3b:00.0"),
    ("00000001:CA:1F.0", "0001:ca:1f.0"),
    ("3B:00.0", "0000:3b:00.0"),
    (" 00000000:A8:00.0 ", "0000:a8:00.0"),
    ("garbage", "garbage"),
])
def test_normalize_pci_bus_id(raw: str, normalized: str) -> None:
    assert normalize_pci_bus_id(raw) == normalized


def test_nvml_error_names() -> None:
    assert nvml_error_name(pynvml, 15) == "GPU_IS_LOST"
    assert nvml_error_name(pynvml, 18) == "LIB_RM_VERSION_MISMATCH"
    assert nvml_error_name(pynvml, 999) == "UNKNOWN"
    assert nvml_error_name(pynvml, 4242) == "ERROR_4242"


def test_importing_the_probe_does_not_import_pynvml() -> None:
    code = "import sys, gpuguard.probes.nvml; print('pynvml' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(LIB)},
                            capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == "False", result.stderr


# A probe run in a fresh process (as a prolog without the agent runs it): pynvml talks to the fake, and neither
# ctypes.util nor what it imports (shutil, tempfile, bz2, lzma, random: ~11M instructions) was imported;
# pynvml's find_library still answers as ctypes.util's, and a later `import ctypes.util` gets the real module.
PROBE_IN_A_FRESH_PROCESS = """
import json, sys
from gpuguard.probes.nvml import read_nvml
obs = read_nvml(library_path=sys.argv[1], env={sys.argv[2]: sys.argv[3]})
unwanted = sorted(m for m in ("ctypes.util", "shutil", "tempfile", "bz2", "lzma", "random") if m in sys.modules)
import pynvml
found = pynvml.find_library("c")
import ctypes.util
print(json.dumps([obs.device_count, obs.status.complete, unwanted, found, ctypes.util.find_library("c"),
                  hasattr(ctypes.util, "__file__")]))
"""


def test_a_probe_in_a_fresh_process_imports_pynvml_without_ctypes_util(fake_lib: Path, tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.txt"
    scenario.write_text(h100_scenario())
    result = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(LIB)!r})\n"
                             + PROBE_IN_A_FRESH_PROCESS, str(fake_lib), ENV_VAR, str(scenario)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    count, complete, unwanted, found, real, is_real_module = json.loads(result.stdout)
    assert (count, complete, unwanted) == (8, True, [])
    assert found == real and found  # e.g. "libc.so.6"
    assert is_real_module


# --------------------------------------------------------------------------- healthy node


def test_healthy_8x_h100_round_trips_exactly(read: ReadFn, fake_lib: Path) -> None:
    obs = read(h100_scenario())
    assert obs.status.complete and obs.status.error is None and not obs.status.timed_out
    assert obs.init_error is None
    assert obs.driver_version == "550.90.07"
    assert obs.device_count == 8
    assert obs.gpus == [expected_gpu(i) for i in range(8)]
    assert 0 < obs.status.duration_s < 1
    assert_session_closed(fake_lib)


def test_full_read_is_fast(read: ReadFn, fake_lib: Path, tmp_path: Path) -> None:
    path = tmp_path / "s.txt"
    path.write_text(h100_scenario())
    kwargs = dict(library_path=str(fake_lib), env={ENV_VAR: str(path)})
    read_nvml(**kwargs)  # warm: pynvml import, dlopen
    times = []
    for _ in range(20):
        started = time.perf_counter()
        obs = read_nvml(**kwargs)
        times.append(time.perf_counter() - started)
        assert len(obs.gpus) == 8 and obs.status.complete
    median = sorted(times)[len(times) // 2]
    print(f"8-GPU read against the fake NVML: median {median * 1e3:.2f} ms")
    assert median < 0.05  # ~0.5 ms measured; the bound only catches a sleep or a per-call slowdown


def test_job_gpu_subset_in_the_order_given(read: ReadFn) -> None:
    obs = read(h100_scenario(), gpu_indices=[5, 2, 5])
    assert obs.gpus == [expected_gpu(5), expected_gpu(2)]
    assert obs.device_count == 8


def test_job_gpu_that_nvml_does_not_have(read: ReadFn) -> None:
    obs = read(h100_scenario("device_count=7"), gpu_indices=[0, 7, 9])
    assert obs.device_count == 7
    assert obs.gpus == [expected_gpu(0), GpuInfo(index=7, fatal_error="NOT_FOUND"),
                        GpuInfo(index=9, fatal_error="NOT_FOUND")]
    assert obs.status.complete


# --------------------------------------------------------------------------- error table


def test_not_supported_everywhere_gives_none_and_no_errors(read: ReadFn) -> None:
    obs = read("device_count=1\ngpu.0.name=Tesla T4\n")
    assert obs.driver_version is None
    (g,) = obs.gpus
    # every other field None, errors {}; the NVLink states NVML could not give are unknown, never "no NVLink"
    assert g == GpuInfo(index=0, name="Tesla T4", nvlink_active=[None] * 18, unsupported=g.unsupported)
    assert {"ecc_mode", "ecc_volatile_uncorrected", "remapped_rows", "recovery_action", "temperature",
            "nvlink"} <= set(g.unsupported)


@pytest.mark.parametrize("code, name", [(15, "GPU_IS_LOST"), (16, "RESET_REQUIRED"), (28, "GPU_NOT_FOUND")])
def test_fatal_error_on_one_gpu_only(read: ReadFn, code: int, name: str) -> None:
    obs = read(h100_scenario(f"gpu.3.error.*={code}"))
    assert obs.gpus[3] == GpuInfo(index=3, fatal_error=name)
    assert [g for g in obs.gpus if g.index != 3] == [expected_gpu(i) for i in range(8) if i != 3]
    assert obs.status.complete


def test_gpu_lost_midway_stops_querying_that_gpu(read: ReadFn) -> None:
    # If the probe went on to ask for utilisation after the GPU was lost, this read would take 2 s.
    obs = read(h100_scenario("gpu.4.error.nvmlDeviceGetPowerUsage=15",
                             "gpu.4.hang.nvmlDeviceGetUtilizationRates=2"))
    assert obs.status.duration_s < 1
    want = expected_gpu(4)
    want.power_mw = want.utilization_gpu_pct = None
    want.processes = []
    want.fatal_error = "GPU_IS_LOST"
    assert obs.gpus[4] == want
    assert obs.gpus[5] == expected_gpu(5)


def test_other_errors_are_recorded_and_reading_goes_on(read: ReadFn) -> None:
    obs = read(h100_scenario("gpu.2.error.nvmlDeviceGetTotalEccErrors=999",
                             "gpu.2.error.nvmlDeviceGetTemperatureV=14",
                             "gpu.2.error.nvmlDeviceGetNvLinkState=10"))
    want = expected_gpu(2)
    want.ecc_volatile_uncorrected = want.ecc_volatile_corrected = None
    want.ecc_aggregate_uncorrected = want.ecc_aggregate_corrected = None
    want.temperature_c = None
    want.nvlink_active = [None] * 18  # links whose state could not be read are unknown (neither up nor down)
    want.errors = {
        "ecc_volatile_uncorrected": "UNKNOWN", "ecc_volatile_corrected": "UNKNOWN",
        "ecc_aggregate_uncorrected": "UNKNOWN", "ecc_aggregate_corrected": "UNKNOWN",
        "temperature": "CORRUPTED_INFOROM", "nvlink": "TIMEOUT",
    }
    assert obs.gpus[2] == want
    assert obs.gpus[1] == expected_gpu(1)


def test_handle_error_that_is_not_fatal(read: ReadFn) -> None:
    obs = read(h100_scenario("gpu.1.error.nvmlDeviceGetHandleByIndex_v2=4"))
    assert obs.gpus[1] == GpuInfo(index=1, errors={"handle": "NO_PERMISSION"})


def test_function_not_found_falls_back_to_the_older_entry_point(read: ReadFn) -> None:
    obs = read(h100_scenario("gpu.1.error.nvmlDeviceGetCurrentClocksEventReasons=13",
                             "gpu.1.error.nvmlDeviceGetTemperatureV=13",
                             "gpu.1.error.nvmlDeviceGetComputeRunningProcesses_v3=13",
                             "gpu.2.error.nvmlDeviceGetCurrentClocksEventReasons=13",
                             "gpu.2.error.nvmlDeviceGetCurrentClocksThrottleReasons=13"))
    assert obs.gpus[1] == expected_gpu(1)
    want = expected_gpu(2)
    want.clock_event_reasons = None  # neither entry point: not supported, not an error
    want.unsupported.insert(5, "clock_event_reasons")
    assert obs.gpus[2] == want


def test_recovery_action_field(read: ReadFn) -> None:
    text = h100_scenario("gpu.6.recovery_action=2").replace("gpu.7.recovery_action=0\n", "")
    obs = read(text)
    assert obs.gpus[6].recovery_action == 2
    assert obs.gpus[7].recovery_action is None and obs.gpus[7].errors == {}
    assert "recovery_action" in obs.gpus[7].unsupported and "recovery_action" not in obs.gpus[6].unsupported
    assert obs.gpus[5].recovery_action == 0


def test_one_field_error_is_recorded_for_that_field(read: ReadFn) -> None:
    """nvmlDeviceGetFieldValues succeeds as a whole while one field carries its own error (per-field nvmlReturn):
    the recovery action is then an error, not a value and not 'not supported'."""
    obs = read(h100_scenario("gpu.6.field_error.230=999", "gpu.5.field_error.230=3"))
    assert obs.gpus[6].recovery_action is None and obs.gpus[6].errors == {"recovery_action": "UNKNOWN"}
    assert obs.gpus[5].recovery_action is None and "recovery_action" in obs.gpus[5].unsupported
    assert obs.gpus[6].temperature_c == 36  # the other fields and queries are read as usual


# --------------------------------------------------------------------------- NVLink and processes


def test_nvlink_states(read: ReadFn) -> None:
    text = h100_scenario("gpu.4.nvlink_down=3,5", "gpu.5.nvlink_count=12", "gpu.7.nvlink_count=0",
                         "gpu.3.error.nvmlDeviceGetNvLinkState=3").replace("gpu.6.nvlink_count=18\n", "")
    obs = read(text)
    assert obs.gpus[4].nvlink_active == [i not in (3, 5) for i in range(18)]
    assert obs.gpus[5].nvlink_active == [True] * 12  # NVML's link count (field 91) says 12: no links 12..17
    assert obs.gpus[7].nvlink_active == []  # NVML says the GPU has no NVLink at all
    # every state NOT_SUPPORTED (and no link count): unknown, which a check must never read as "no NVLinks"
    assert obs.gpus[6].nvlink_active == [None] * 18 and "nvlink" in obs.gpus[6].unsupported
    assert obs.gpus[3].nvlink_active == [None] * 18 and "nvlink" in obs.gpus[3].unsupported
    assert obs.gpus[4].errors == obs.gpus[5].errors == obs.gpus[6].errors == obs.gpus[3].errors == {}

    # NVML's link count decides how many links are read; without it (older drivers), `nvlinks` bounds the probe
    assert read(text, nvlinks=4, gpu_indices=[5]).gpus[0].nvlink_active == [True] * 12
    no_count = text + "gpu.4.field_error.91=3\ngpu.5.field_error.91=3\n"
    limited = read(no_count, nvlinks=4, gpu_indices=[4, 5])
    assert [g.nvlink_active for g in limited.gpus] == [[True, True, True, False], [True] * 4]
    asked_more = read(no_count, nvlinks=18, gpu_indices=[5])
    # links 12..17 answer NOT_SUPPORTED below the driver's bound: without a link count they are unknown
    assert asked_more.gpus[0].nvlink_active == [True] * 12 + [None] * 6


def test_processes(read: ReadFn) -> None:
    text = h100_scenario("gpu.0.process.1=31337:0", "gpu.0.process.7=4000:0x40000000")
    obs = read(text, gpu_indices=[0, 1])
    assert obs.gpus[0].processes == [GpuProcess(1000, 512), GpuProcess(31337, 0), GpuProcess(4000, 1024)]
    without = read(text, gpu_indices=[0], with_processes=False)
    assert without.gpus[0].processes == []
    want = expected_gpu(0)
    want.processes = []
    assert without.gpus[0] == want


# --------------------------------------------------------------------------- init and plumbing


@pytest.mark.parametrize("text, name", [
    ("init_error=18\n", "LIB_RM_VERSION_MISMATCH"),
    ("init_error=9\n", "DRIVER_NOT_LOADED"),
    ("init_error=999\n", "UNKNOWN"),
])
def test_init_error(read: ReadFn, fake_lib: Path, text: str, name: str) -> None:
    obs = read(text)
    assert obs.init_error == name
    assert not obs.status.complete and name in (obs.status.error or "")
    assert obs.gpus == [] and obs.device_count is None
    assert_session_closed(fake_lib)


def test_missing_scenario_file_is_driver_not_loaded(fake_lib: Path, tmp_path: Path) -> None:
    obs = read_nvml(library_path=str(fake_lib), env={ENV_VAR: str(tmp_path / "absent.txt")})
    assert obs.init_error == "DRIVER_NOT_LOADED" and not obs.status.complete


def test_unloadable_library_is_library_not_found(tmp_path: Path) -> None:
    obs = read_nvml(library_path=str(tmp_path / "libnvidia-ml.so.1"))
    assert obs.init_error == "LIBRARY_NOT_FOUND" and not obs.status.complete
    assert obs.gpus == []


def test_env_is_restored_after_init(read: ReadFn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("GPUGUARD_TEST_MARKER", "before")
    obs = read(h100_scenario())
    assert obs.status.complete
    assert ENV_VAR not in os.environ
    assert os.environ["GPUGUARD_TEST_MARKER"] == "before"


def test_device_count_failure_is_incomplete(read: ReadFn, fake_lib: Path) -> None:
    obs = read(h100_scenario("error.nvmlDeviceGetCount_v2=999"))
    assert not obs.status.complete and obs.status.error == "nvmlDeviceGetCount: UNKNOWN"
    assert obs.init_error is None and obs.driver_version == "550.90.07" and obs.gpus == []
    assert_session_closed(fake_lib)


def test_unexpected_exception_never_escapes(read: ReadFn, fake_lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(handle):
        raise ValueError("binding bug")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetSerial", broken)
    obs = read(h100_scenario())
    assert not obs.status.complete
    assert obs.status.error == "ValueError: binding bug"
    assert_session_closed(fake_lib)  # nvmlShutdown ran anyway
    monkeypatch.undo()
    assert read(h100_scenario()).status.complete


def test_refuses_to_swap_library_under_an_open_session(read: ReadFn, fake_lib: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other" / "libnvidia-ml.so.1"
    other.parent.mkdir()
    shutil.copy(fake_lib, other)
    scenario = tmp_path / "s.txt"
    scenario.write_text(h100_scenario())
    read(h100_scenario())  # makes fake_lib pynvml's library
    monkeypatch.setenv(ENV_VAR, str(scenario))
    pynvml.nvmlInit()
    try:
        obs = read_nvml(library_path=str(other))
    finally:
        pynvml.nvmlShutdown()
    assert not obs.status.complete and "NvmlLibraryInUse" in (obs.status.error or "")
    assert read(h100_scenario()).gpus[0] == expected_gpu(0)
