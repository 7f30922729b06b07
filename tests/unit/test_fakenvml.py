"""The fake libnvidia-ml.so.1 (gpuguard/simulate/fakenvml.c), driven through the real pynvml binding.

The library is compiled once per test session into a fixed directory, so every test in the process
loads the same file (pynvml keeps one library per process) and only the scenario file changes between
nvmlInit calls. Anything that could crash or hang the interpreter runs in a subprocess.
"""

from __future__ import annotations

import ast
import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

LIB = Path(__file__).resolve().parents[2] / "lib"
sys.path.insert(0, str(LIB))  # run from a checkout without install

import pynvml  # noqa: E402

from gpuguard.probes.nvml import install_nvml_library  # noqa: E402
from h100 import BUSES, GIB, H100_MEMORY, h100_gpu  # noqa: E402
from gpuguard.simulate.build import build_fake_nvml  # noqa: E402

def h100_scenario(*extra: str) -> str:
    head = "driver_version=550.90.07\nnvml_version=12.550.90.07\ncuda_driver_version=12040\ndevice_count=8\n"
    return head + "".join(h100_gpu(i) for i in range(8)) + "".join(line + "\n" for line in extra)


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A fixed directory under the session's base temp: every test module builds (or reuses) the same
    # file, so the library pynvml holds never changes within the process.
    return build_fake_nvml(tmp_path_factory.getbasetemp() / "fakenvml")


@pytest.fixture
def raw(fake_lib: Path) -> ctypes.CDLL:
    """Direct ctypes access to the same loaded library (dlopen of one path returns one object)."""
    install_nvml_library(str(fake_lib))
    return ctypes.CDLL(str(fake_lib))


@pytest.fixture
def scenario_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        path = tmp_path / "scenario.txt"
        path.write_text(text)
        monkeypatch.setenv("GPUGUARD_FAKE_NVML_FILE", str(path))
        return path

    return write


@pytest.fixture
def nvml(fake_lib: Path, scenario_file: Callable[[str], Path], raw: ctypes.CDLL) -> Iterator[Callable[[str], Any]]:
    """An open pynvml session on a scenario: call nvml(text) once per test."""
    opened = []

    def open_session(text: str):
        scenario_file(text)
        pynvml.nvmlInit()
        opened.append(True)
        return pynvml

    yield open_session
    for _ in opened:
        pynvml.nvmlShutdown()


def run_python(code: str, env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(LIB), **env}
    return subprocess.run([sys.executable, "-c", code, *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------- ABI


def test_pynvml_struct_sizes_match_the_c_layouts() -> None:
    # fakenvml.c _Static_asserts the same numbers; if nvidia-ml-py changes a layout, this fails first.
    assert ctypes.sizeof(pynvml.nvmlPciInfo_t) == 68
    assert ctypes.sizeof(pynvml.nvmlPciInfo_v2_t) == 52
    assert ctypes.sizeof(pynvml.c_nvmlMemory_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlMemory_v2_t) == 40
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlFieldValue_t) == 40
    assert ctypes.sizeof(pynvml.c_nvmlTemperature_v1_t) == 12
    assert pynvml.nvmlMemory_v2 == 40 | 2 << 24
    assert pynvml.nvmlTemperature_v1 == 12 | 1 << 24


def test_drop_in_replacement_found_through_ld_library_path(fake_lib: Path, tmp_path: Path) -> None:
    scenario = tmp_path / "s.txt"
    scenario.write_text(h100_scenario())
    code = textwrap.dedent("""\
        import pynvml as n
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(7)
        print(n.nvmlDeviceGetCount(), n.nvmlDeviceGetName(h), n.nvmlDeviceGetPciInfo(h).busId,
              n.nvmlSystemGetDriverVersion(), sep="|")
        n.nvmlShutdown()
        """)
    result = run_python(code, {"LD_LIBRARY_PATH": str(fake_lib.parent),
                               "GPUGUARD_FAKE_NVML_FILE": str(scenario)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8|NVIDIA H100 80GB HBM3|00000000:CA:00.0|550.90.07"


# --------------------------------------------------------------------------- values


def test_healthy_h100_values_round_trip(nvml) -> None:
    n = nvml(h100_scenario())
    assert n.nvmlDeviceGetCount() == 8
    assert n.nvmlSystemGetDriverVersion() == "550.90.07"
    assert n.nvmlSystemGetNVMLVersion() == "12.550.90.07"
    assert n.nvmlSystemGetCudaDriverVersion() == 12040
    assert n.nvmlSystemGetCudaDriverVersion_v2() == 12040
    for i in (0, 5):
        h = n.nvmlDeviceGetHandleByIndex(i)
        assert n.nvmlDeviceGetIndex(h) == i
        assert n.nvmlDeviceGetMinorNumber(h) == i
        assert n.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
        assert n.nvmlDeviceGetUUID(h) == f"GPU-{i:08x}-aaaa-bbbb-cccc-ddddeeeeffff"
        assert n.nvmlDeviceGetSerial(h) == str(1650123456789 + i)
        pci = n.nvmlDeviceGetPciInfo(h)
        assert (pci.busId, pci.busIdLegacy) == (f"00000000:{BUSES[i]}:00.0", f"0000:{BUSES[i]}:00.0")
        assert (pci.domain, pci.bus, pci.device) == (0, int(BUSES[i], 16), 0)
        assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x233010DE, 0x16C110DE)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        assert (mem.total, mem.used, mem.free) == (H100_MEMORY, i * GIB, H100_MEMORY - i * GIB)
        assert n.nvmlDeviceGetEccMode(h) == [1, 1]
        assert n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC) == i
        assert n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC) == 0
        assert n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_AGGREGATE_ECC) == 100 + i
        assert n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                             n.NVML_AGGREGATE_ECC) == i // 4
        assert n.nvmlDeviceGetRemappedRows(h) == (i, 0, 0, 0)
        assert n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU) == 30 + i
        assert n.nvmlDeviceGetTemperatureV(h, n.NVML_TEMPERATURE_GPU) == 30 + i
        thresholds = [n.nvmlDeviceGetTemperatureThreshold(h, t) for t in range(4)]
        assert thresholds == [95, 89, 95, 87]  # SHUTDOWN, SLOWDOWN, MEM_MAX, GPU_MAX
        assert n.nvmlDeviceGetCurrentClocksEventReasons(h) == 1
        assert n.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 1
        assert n.nvmlDeviceGetSupportedClocksEventReasons(h) == 0x1FF
        assert n.nvmlDeviceGetSupportedClocksThrottleReasons(h) == 0x1FF
        assert [n.nvmlDeviceGetCurrPcieLinkGeneration(h), n.nvmlDeviceGetMaxPcieLinkGeneration(h),
                n.nvmlDeviceGetGpuMaxPcieLinkGeneration(h), n.nvmlDeviceGetCurrPcieLinkWidth(h),
                n.nvmlDeviceGetMaxPcieLinkWidth(h)] == [5, 5, 5, 16, 16]
        assert [n.nvmlDeviceGetNvLinkState(h, link) for link in range(18)] == [1] * 18
        assert n.nvmlDeviceGetPowerUsage(h) == 69000 + i
        assert n.nvmlDeviceGetEnforcedPowerLimit(h) == 700000
        util = n.nvmlDeviceGetUtilizationRates(h)
        assert (util.gpu, util.memory) == (i, 2 * i)
        assert [n.nvmlDeviceGetClockInfo(h, c) for c in (n.NVML_CLOCK_GRAPHICS, n.NVML_CLOCK_SM,
                                                          n.NVML_CLOCK_MEM)] == [1980, 1980, 2619]
        assert [n.nvmlDeviceGetMaxClockInfo(h, c) for c in (n.NVML_CLOCK_GRAPHICS, n.NVML_CLOCK_SM,
                                                             n.NVML_CLOCK_MEM)] == [1980, 1980, 2619]
        assert n.nvmlDeviceGetPersistenceMode(h) == 1
        assert n.nvmlDeviceGetComputeRunningProcesses(h) == []
        assert n.nvmlDeviceGetGraphicsRunningProcesses(h) == []


NOT_SUPPORTED_CALLS = {
    "uuid": lambda n, h: n.nvmlDeviceGetUUID(h),
    "serial": lambda n, h: n.nvmlDeviceGetSerial(h),
    "minor": lambda n, h: n.nvmlDeviceGetMinorNumber(h),
    "pci": lambda n, h: n.nvmlDeviceGetPciInfo(h),
    "memory": lambda n, h: n.nvmlDeviceGetMemoryInfo(h),
    "memory_v2": lambda n, h: n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2),
    "ecc_mode": lambda n, h: n.nvmlDeviceGetEccMode(h),
    "ecc_total": lambda n, h: n.nvmlDeviceGetTotalEccErrors(h, 1, 0),
    "retired": lambda n, h: n.nvmlDeviceGetRetiredPages(h, 0),
    "retired_v2": lambda n, h: n.nvmlDeviceGetRetiredPages_v2(h, 1),
    "retired_pending": lambda n, h: n.nvmlDeviceGetRetiredPagesPendingStatus(h),
    "remapped": lambda n, h: n.nvmlDeviceGetRemappedRows(h),
    "temperature": lambda n, h: n.nvmlDeviceGetTemperature(h, 0),
    "temperature_v": lambda n, h: n.nvmlDeviceGetTemperatureV(h, 0),
    "threshold": lambda n, h: n.nvmlDeviceGetTemperatureThreshold(h, 1),
    "clock_reasons": lambda n, h: n.nvmlDeviceGetCurrentClocksEventReasons(h),
    "supported_reasons": lambda n, h: n.nvmlDeviceGetSupportedClocksEventReasons(h),
    "pcie_gen": lambda n, h: n.nvmlDeviceGetCurrPcieLinkGeneration(h),
    "pcie_width": lambda n, h: n.nvmlDeviceGetMaxPcieLinkWidth(h),
    "nvlink": lambda n, h: n.nvmlDeviceGetNvLinkState(h, 0),
    "power": lambda n, h: n.nvmlDeviceGetPowerUsage(h),
    "power_limit": lambda n, h: n.nvmlDeviceGetEnforcedPowerLimit(h),
    "utilization": lambda n, h: n.nvmlDeviceGetUtilizationRates(h),
    "clock": lambda n, h: n.nvmlDeviceGetClockInfo(h, 1),
    "max_clock": lambda n, h: n.nvmlDeviceGetMaxClockInfo(h, 2),
    "persistence": lambda n, h: n.nvmlDeviceGetPersistenceMode(h),
    "driver_version": lambda n, h: n.nvmlSystemGetDriverVersion(),
    "cuda_version": lambda n, h: n.nvmlSystemGetCudaDriverVersion(),
}


@pytest.mark.parametrize("query", sorted(NOT_SUPPORTED_CALLS))
def test_absent_value_is_not_supported(nvml, query: str) -> None:
    n = nvml("gpu.0.name=Bare GPU\n")
    h = n.nvmlDeviceGetHandleByIndex(0)
    assert n.nvmlDeviceGetName(h) == "Bare GPU"
    with pytest.raises(n.NVMLError_NotSupported):
        NOT_SUPPORTED_CALLS[query](n, h)


def test_partial_groups_default_to_zero(nvml) -> None:
    n = nvml("gpu.0.remap.uncorrectable=3\ngpu.0.ecc_pending=1\ngpu.0.utilization.memory=7\ngpu.0.memory_total=100\n")
    h = n.nvmlDeviceGetHandleByIndex(0)
    assert n.nvmlDeviceGetRemappedRows(h) == (0, 3, 0, 0)
    assert n.nvmlDeviceGetEccMode(h) == [1, 1]  # current follows pending when only one is given
    util = n.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (0, 7)
    mem = n.nvmlDeviceGetMemoryInfo(h)
    assert (mem.total, mem.used, mem.free) == (100, 0, 100)


def test_memory_v2_and_version_check(nvml, raw: ctypes.CDLL) -> None:
    n = nvml(h100_scenario())
    h = n.nvmlDeviceGetHandleByIndex(2)
    mem = n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2)
    assert (mem.total, mem.reserved, mem.used, mem.free) == (H100_MEMORY, 0, 2 * GIB, H100_MEMORY - 2 * GIB)
    wrong = pynvml.c_nvmlMemory_v2_t()
    wrong.version = 1 << 24 | 40
    assert raw.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(wrong)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    temp = pynvml.c_nvmlTemperature_v1_t()
    temp.version = 2 << 24 | 12
    assert raw.nvmlDeviceGetTemperatureV(h, ctypes.byref(temp)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_legacy_pci_info_fills_only_the_old_layout(nvml, raw: ctypes.CDLL) -> None:
    n = nvml(h100_scenario())
    h = n.nvmlDeviceGetHandleByIndex(3)
    buf = ctypes.create_string_buffer(b"\xee" * 80, 80)
    assert raw.nvmlDeviceGetPciInfo_v2(h, buf) == 0
    old = pynvml.nvmlPciInfo_v2_t.from_buffer_copy(buf.raw[:52])
    assert (old.busId, old.bus, old.pciDeviceId) == ("0000:86:00.0", 0x86, 0x233010DE)
    assert buf.raw[52:] == b"\xee" * 28  # the 52-byte struct must not be overrun


def test_temperature_threshold_enum(nvml) -> None:
    n = nvml(h100_scenario())
    h = n.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(n.NVMLError_NotSupported):
        n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_MIN)
    with pytest.raises(n.NVMLError_InvalidArgument):
        n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_COUNT)
    with pytest.raises(n.NVMLError_InvalidArgument):
        n.nvmlDeviceGetTemperature(h, 1)  # NVML_TEMPERATURE_GPU is the only sensor
    with pytest.raises(n.NVMLError_InvalidArgument):
        n.nvmlDeviceGetClockInfo(h, 4)
    with pytest.raises(n.NVMLError_NotSupported):
        n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_VIDEO)


def test_retired_pages_counts_and_pending(nvml) -> None:
    n = nvml("gpu.0.retired.sbe=3\ngpu.0.retired.dbe=0\ngpu.0.retired.pending=1\n")
    h = n.nvmlDeviceGetHandleByIndex(0)
    sbe = n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    assert len(sbe) == 3 and len(set(sbe)) == 3
    assert n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR) == []
    with_times = n.nvmlDeviceGetRetiredPages_v2(h, 0)
    assert [p["address"] for p in with_times] == sbe and all(p["timestamp"] > 0 for p in with_times)
    assert n.nvmlDeviceGetRetiredPagesPendingStatus(h) == 1
    with pytest.raises(n.NVMLError_InvalidArgument):
        n.nvmlDeviceGetRetiredPages(h, 2)


def test_recovery_action_field_value_per_entry_return(nvml) -> None:
    n = nvml("gpu.0.recovery_action=2\ngpu.1.name=no recovery field\n")
    values = n.nvmlDeviceGetFieldValues(n.nvmlDeviceGetHandleByIndex(0),
                                        [n.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, n.NVML_FI_DEV_ECC_CURRENT])
    assert values[0].nvmlReturn == 0
    assert values[0].valueType == n.NVML_VALUE_TYPE_UNSIGNED_INT
    assert values[0].value.uiVal == n.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    assert values[0].fieldId == 230 and values[0].timestamp > 0
    assert values[1].nvmlReturn == n.NVML_ERROR_NOT_SUPPORTED
    other = n.nvmlDeviceGetFieldValues(n.nvmlDeviceGetHandleByIndex(1), [230])
    assert other[0].nvmlReturn == n.NVML_ERROR_NOT_SUPPORTED


def test_nvlink_states_and_bounds(nvml) -> None:
    n = nvml("gpu.0.nvlink_count=18\ngpu.0.nvlink_down=3, 5,bogus,99\ngpu.1.nvlink_count=12\ngpu.2.name=PCIe\n")
    h0, h1, h2 = (n.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    states = [n.nvmlDeviceGetNvLinkState(h0, link) for link in range(18)]
    assert states == [0 if link in (3, 5) else 1 for link in range(18)]
    assert [n.nvmlDeviceGetNvLinkState(h1, link) for link in range(12)] == [1] * 12
    with pytest.raises(n.NVMLError_NotSupported):
        n.nvmlDeviceGetNvLinkState(h1, 12)  # below the driver's bound: the GPU just lacks the link
    for h in (h0, h1, h2):
        with pytest.raises(n.NVMLError_InvalidArgument):
            n.nvmlDeviceGetNvLinkState(h, 18)
    with pytest.raises(n.NVMLError_NotSupported):
        n.nvmlDeviceGetNvLinkState(h2, 0)


def test_processes_protocol(nvml, raw: ctypes.CDLL) -> None:
    n = nvml("gpu.0.process.0=4242:1073741824\ngpu.0.process.5=77:0x100000\ngpu.1.name=idle\n")
    h = n.nvmlDeviceGetHandleByIndex(0)
    for procs in (n.nvmlDeviceGetComputeRunningProcesses(h), n.nvmlDeviceGetComputeRunningProcesses_v2(h)):
        assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, GIB), (77, 1 << 20)]
        assert {(p.gpuInstanceId, p.computeInstanceId) for p in procs} == {(0xFFFFFFFF, 0xFFFFFFFF)}
    assert n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(1)) == []
    assert n.nvmlDeviceGetGraphicsRunningProcesses(h) == []

    count = ctypes.c_uint(1)
    infos = (pynvml.c_nvmlProcessInfo_v3_t * 2)()
    assert raw.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(count), infos) == 7  # INSUFFICIENT_SIZE
    assert count.value == 2
    count = ctypes.c_uint(2)
    assert raw.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(count), None) == 2  # NULL array

    class ProcessInfoV1(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    v1 = (ProcessInfoV1 * 3)()
    count = ctypes.c_uint(3)
    assert raw.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(count), v1) == 0
    assert count.value == 2 and [(p.pid, p.usedGpuMemory) for p in v1[:2]] == [(4242, GIB), (77, 1 << 20)]


def test_handle_lookups(nvml) -> None:
    n = nvml(h100_scenario())
    six = n.nvmlDeviceGetHandleByIndex(6)
    address = ctypes.addressof(six.contents)
    assert ctypes.addressof(n.nvmlDeviceGetHandleByUUID(n.nvmlDeviceGetUUID(six)).contents) == address
    for bus_id in ("00000000:B9:00.0", "0000:b9:00.0", "b9:00.0"):
        assert ctypes.addressof(n.nvmlDeviceGetHandleByPciBusId(bus_id).contents) == address
    with pytest.raises(n.NVMLError_NotFound):
        n.nvmlDeviceGetHandleByUUID("GPU-nope")
    with pytest.raises(n.NVMLError_NotFound):
        n.nvmlDeviceGetHandleByPciBusId("0000:01:00.0")
    with pytest.raises(n.NVMLError_InvalidArgument):
        n.nvmlDeviceGetHandleByPciBusId("not a bus id")
    with pytest.raises(n.NVMLError_InvalidArgument):
        n.nvmlDeviceGetHandleByIndex(8)


# --------------------------------------------------------------------------- errors and arguments


def test_error_strings_match_nvml(raw: ctypes.CDLL) -> None:
    assert pynvml.nvmlErrorString(15) == "GPU is lost"
    assert pynvml.nvmlErrorString(0) == "Success"
    assert pynvml.nvmlErrorString(9) == "Driver Not Loaded"
    assert pynvml.nvmlErrorString(18) == "Driver/library version mismatch"
    assert pynvml.nvmlErrorString(12345) == "Unknown Error"


def test_bad_handles_and_null_pointers(nvml, raw: ctypes.CDLL) -> None:
    n = nvml(h100_scenario())
    h = n.nvmlDeviceGetHandleByIndex(0)
    value = ctypes.c_uint()
    assert raw.nvmlDeviceGetPowerUsage(h, None) == 2
    assert raw.nvmlDeviceGetEccMode(h, ctypes.byref(value), None) == 2
    assert raw.nvmlDeviceGetCount_v2(None) == 2
    assert raw.nvmlDeviceGetHandleByIndex_v2(0, None) == 2
    assert raw.nvmlDeviceGetFieldValues(h, 1, None) == 2
    bogus = ctypes.c_void_p(ctypes.addressof(h.contents) + 1)  # inside the array but not a handle
    assert raw.nvmlDeviceGetPowerUsage(bogus, ctypes.byref(value)) == 2
    assert raw.nvmlDeviceGetPowerUsage(ctypes.c_void_p(8), ctypes.byref(value)) == 2
    assert raw.nvmlDeviceGetPowerUsage(h, ctypes.byref(value)) == 0 and value.value == 69000


def test_short_buffers_are_insufficient_size(nvml, raw: ctypes.CDLL) -> None:
    n = nvml(h100_scenario())
    h = n.nvmlDeviceGetHandleByIndex(0)
    name = "NVIDIA H100 80GB HBM3"
    small = ctypes.create_string_buffer(len(name))  # no room for the NUL
    assert raw.nvmlDeviceGetName(h, small, len(name)) == 7
    exact = ctypes.create_string_buffer(len(name) + 1)
    assert raw.nvmlDeviceGetName(h, exact, len(name) + 1) == 0 and exact.value.decode() == name
    assert raw.nvmlSystemGetDriverVersion(ctypes.create_string_buffer(4), 4) == 7


def test_uninitialized_and_refcount(nvml, raw: ctypes.CDLL, fake_lib: Path) -> None:
    count = ctypes.c_uint()
    assert raw.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 1  # UNINITIALIZED
    assert raw.nvmlShutdown() == 1
    n = nvml(h100_scenario())  # session 1 (the fixture closes it)
    assert raw.nvmlInit_v2() == 0  # session 2
    assert raw.nvmlShutdown() == 0
    assert n.nvmlDeviceGetCount() == 8  # session 1 still open
    assert raw.nvmlInit() == 0
    assert raw.nvmlShutdown() == 0


def test_gpu_error_override_hits_that_gpu_only(nvml) -> None:
    n = nvml(h100_scenario("gpu.3.error.*=15", "gpu.5.error.nvmlDeviceGetPowerUsage=999",
                           "gpu.5.error.nvmlDeviceGetTemperature=0"))
    with pytest.raises(n.NVMLError_GpuIsLost):
        n.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(n.NVMLError_GpuIsLost):
        n.nvmlDeviceGetHandleByUUID("GPU-00000003-aaaa-bbbb-cccc-ddddeeeeffff")
    five = n.nvmlDeviceGetHandleByIndex(5)
    with pytest.raises(n.NVMLError_Unknown):
        n.nvmlDeviceGetPowerUsage(five)
    assert n.nvmlDeviceGetTemperature(five, 0) == 35  # error 0 = no error
    assert n.nvmlDeviceGetPowerUsage(n.nvmlDeviceGetHandleByIndex(4)) == 69004
    assert n.nvmlDeviceGetCount() == 8


def test_global_error_override_spares_shutdown(nvml, raw: ctypes.CDLL) -> None:
    n = nvml("device_count=1\nerror.*=999\nerror.nvmlDeviceGetCount_v2=0\ngpu.0.name=x\n")
    assert n.nvmlDeviceGetCount() == 1
    with pytest.raises(n.NVMLError_Unknown):
        n.nvmlSystemGetDriverVersion()
    with pytest.raises(n.NVMLError_Unknown):
        n.nvmlDeviceGetHandleByIndex(0)


@pytest.mark.parametrize("setup, expected", [
    ("unset", pynvml.NVMLError_DriverNotLoaded),
    ("missing", pynvml.NVMLError_DriverNotLoaded),
    ("directory", pynvml.NVMLError_DriverNotLoaded),
    ("init_error=18", pynvml.NVMLError_LibRmVersionMismatch),
    ("init_error=0x10", pynvml.NVMLError_ResetRequired),
])
def test_init_failures(raw: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: str,
                       expected: type) -> None:
    if setup == "unset":
        monkeypatch.delenv("GPUGUARD_FAKE_NVML_FILE", raising=False)
    elif setup == "missing":
        monkeypatch.setenv("GPUGUARD_FAKE_NVML_FILE", str(tmp_path / "nope.txt"))
    elif setup == "directory":
        monkeypatch.setenv("GPUGUARD_FAKE_NVML_FILE", str(tmp_path))
    else:
        (tmp_path / "s.txt").write_text(f"{setup}\ndevice_count=1\n")
        monkeypatch.setenv("GPUGUARD_FAKE_NVML_FILE", str(tmp_path / "s.txt"))
    with pytest.raises(expected):
        pynvml.nvmlInit()
    count = ctypes.c_uint()
    assert raw.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 1  # a failed init opens no session


def test_scenario_is_reread_only_when_no_session_is_open(nvml, scenario_file, raw: ctypes.CDLL) -> None:
    n = nvml("device_count=2\n")
    scenario_file("device_count=5\n")
    assert raw.nvmlInit_v2() == 0  # nested init: real NVML does not re-read either
    assert n.nvmlDeviceGetCount() == 2
    assert raw.nvmlShutdown() == 0
    n.nvmlShutdown()
    n.nvmlInit()  # the fixture's shutdown closes this one
    assert n.nvmlDeviceGetCount() == 5


# --------------------------------------------------------------------------- parsing


def test_parsing_rules(nvml) -> None:
    text = "\n".join([
        "# comment",
        "   ",
        "  gpu.0.temperature =  010  ",  # decimal, not octal; blanks trimmed
        "gpu.0.power_usage=0x1F4",
        "gpu.0.power_limit=12abc",  # bad number: ignored
        "gpu.0.utilization.gpu=99999999999999999999999",  # overflow: ignored
        "gpu.0.name=first",
        "gpu.0.name=NVIDIA A100-SXM4-80GB",  # a later line wins
        "gpu.0.serial=" + "9" * 200,  # too long to store: ignored rather than truncated
        "gpu.0.minor=" + "1" * 5000,  # overlong line: ignored
        "gpu.0.pcie.gen_max=4\0garbage",  # NUL byte: the line is dropped
        "no equals sign",
        "gpu.x.temperature=1",
        "gpu.64.temperature=1",  # past the last simulated GPU
        "gpu.-1.temperature=1",
        "gpu.0.unknown_key=5",
        "gpu.0.process.64=1:1",  # slot out of range
        "gpu.0.process.1=12:notanumber",
        "gpu.0.process.2=13",
        "gpu.0.pci_bus_id=zz:00.0",
        "gpu.0.hang.nvmlDeviceGetName=-1",
        "gpu.0.error.bad name=15",
        "gpu.2.pcie.width_max=8\r",  # CRLF file
        "gpu.0.clocks_event_reasons=0x8000000000000000",
    ])
    n = nvml(text)
    assert n.nvmlDeviceGetCount() == 3  # highest gpu index seen + 1
    h = n.nvmlDeviceGetHandleByIndex(0)
    assert n.nvmlDeviceGetTemperature(h, 0) == 10
    assert n.nvmlDeviceGetPowerUsage(h) == 500
    assert n.nvmlDeviceGetName(h) == "NVIDIA A100-SXM4-80GB"
    assert n.nvmlDeviceGetCurrentClocksEventReasons(h) == 1 << 63
    assert n.nvmlDeviceGetMaxPcieLinkWidth(n.nvmlDeviceGetHandleByIndex(2)) == 8
    for call in (n.nvmlDeviceGetEnforcedPowerLimit, n.nvmlDeviceGetSerial, n.nvmlDeviceGetMinorNumber,
                 n.nvmlDeviceGetMaxPcieLinkGeneration, n.nvmlDeviceGetPciInfo, n.nvmlDeviceGetUtilizationRates):
        with pytest.raises(n.NVMLError_NotSupported):
            call(h)
    assert n.nvmlDeviceGetComputeRunningProcesses(h) == []


def test_garbage_files_never_crash_the_process(fake_lib: Path, tmp_path: Path) -> None:
    code = textwrap.dedent("""\
        import os, random, sys
        from gpuguard.probes.nvml import install_nvml_library
        import pynvml as n
        install_nvml_library(sys.argv[1])
        path = os.environ["GPUGUARD_FAKE_NVML_FILE"]
        rng = random.Random(1234)
        pieces = [b"gpu.", b"0", b"1", b"63", b"64", b"99999999999", b".", b"=", b"\\n", b"\\0", b"0x", b"-",
                  b"hang.", b"error.", b"*", b"process.", b"nvlink_down", b"pci_bus_id", b"name", b"uuid",
                  b"memory_total", b"device_count", b"init_error", b":", b",", b"ff", b"\\xff\\xfe", b" "]
        outcomes = set()
        for i in range(300):
            if i % 3 == 0:
                blob = rng.randbytes(rng.randrange(0, 3000))
            else:
                blob = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 400)))
            blob = blob.replace(b"hang.", b"hang_.")  # never actually sleep
            with open(path, "wb") as f:
                f.write(blob)
            try:
                n.nvmlInit()
            except n.NVMLError as e:
                outcomes.add(e.value)
                continue
            outcomes.add(0)
            for k in range(n.nvmlDeviceGetCount()):
                try:
                    h = n.nvmlDeviceGetHandleByIndex(k)
                    n.nvmlDeviceGetName(h); n.nvmlDeviceGetPciInfo(h); n.nvmlDeviceGetComputeRunningProcesses(h)
                except n.NVMLError:
                    pass
            n.nvmlShutdown()
        print(sorted(outcomes))
        """)
    result = run_python(code, {"GPUGUARD_FAKE_NVML_FILE": str(tmp_path / "garbage")}, str(fake_lib),
                        timeout=120)
    assert result.returncode == 0, result.stderr
    outcomes = ast.literal_eval(result.stdout.strip())  # init results seen (init_error= may set any)
    assert 0 in outcomes  # most garbage parses to a (sparse) scenario that initialises


# --------------------------------------------------------------------------- hangs


HANG_PROBE = textwrap.dedent("""\
    import sys, threading, time
    from gpuguard.probes.nvml import install_nvml_library
    import pynvml
    install_nvml_library(sys.argv[1])
    done = threading.Event()
    def call():
        pynvml.nvmlInit()
        done.set()
    threading.Thread(target=call, daemon=True).start()
    print("returned" if done.wait(0.5) else "hung", flush=True)
    """)


@pytest.mark.parametrize("scenario, expected", [
    ("hang.nvmlInitWithFlags=5\ndevice_count=1\n", "hung"),
    ("hang.*=5\ndevice_count=1\n", "hung"),
    ("hang.nvmlInit_v2=5\ndevice_count=1\n", "returned"),  # another symbol's hang does not apply
])
def test_init_hang(fake_lib: Path, tmp_path: Path, scenario: str, expected: str) -> None:
    path = tmp_path / "s.txt"
    path.write_text(scenario)
    env = {**os.environ, "PYTHONPATH": str(LIB), "GPUGUARD_FAKE_NVML_FILE": str(path)}
    proc = subprocess.Popen([sys.executable, "-c", HANG_PROBE, str(fake_lib)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip() if proc.stdout else ""
    finally:
        proc.kill()  # the hung call would otherwise keep the interpreter alive for 5 s
        proc.wait(timeout=10)
    assert line == expected, proc.stderr.read() if proc.stderr else ""


def test_gpu_hang_delays_one_gpu_then_answers(nvml) -> None:
    n = nvml(h100_scenario("gpu.1.hang.nvmlDeviceGetPowerUsage=0.3"))
    h0, h1 = n.nvmlDeviceGetHandleByIndex(0), n.nvmlDeviceGetHandleByIndex(1)
    started = time.monotonic()
    assert n.nvmlDeviceGetPowerUsage(h0) == 69000
    assert time.monotonic() - started < 0.1
    started = time.monotonic()
    assert n.nvmlDeviceGetPowerUsage(h1) == 69001
    assert time.monotonic() - started >= 0.28
