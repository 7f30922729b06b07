"""Slurm's GPU ids -> NVML GPUs (issue 9): GRES indices are /dev/nvidiaN minor numbers, UUIDs name GPUs and MIG
slices, and a MIG GRES index is never read as an NVML index."""

from __future__ import annotations

import pytest

from gpuguard.context import context_from_env, parse_gpu_ids
from gpuguard.pipeline.gpumap import resolve_job_gpus
from gpuguard.model import GpuInfo
from gpuguard.model import Severity
from simnode import run_sim

from simnode import MemorySlurm, make_cfg, write_scenario

# A 4x H100 NVL node as in ceems-dev/ceems discussion #513: NVML orders by PCI bus, the kernel's minor numbers differ.
NVL = [GpuInfo(index=0, uuid="GPU-aaaa0000-0000-0000-0000-000000000000", minor_number=2),
       GpuInfo(index=1, uuid="GPU-bbbb0000-0000-0000-0000-000000000000", minor_number=0),
       GpuInfo(index=2, uuid="GPU-cccc0000-0000-0000-0000-000000000000", minor_number=3),
       GpuInfo(index=3, uuid="GPU-dddd0000-0000-0000-0000-000000000000", minor_number=1)]


def test_gres_index_is_the_minor_number():
    m = resolve_job_gpus(("0", "1"), NVL)
    assert m.indices == (1, 3) and not m.unmapped  # /dev/nvidia0 and /dev/nvidia1, not NVML 0 and 1
    assert resolve_job_gpus(("0", "1"), NVL, mode="nvml_index").indices == (0, 1)


def test_uuids_and_mig_slices_map_to_their_gpu():
    gpus = [GpuInfo(index=0, uuid="GPU-aaaa", minor_number=0, mig_enabled=True,
                    mig_devices=["MIG-11111111-2222-3333-4444-555555555555"]),
            GpuInfo(index=1, uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000", minor_number=1, mig_enabled=False)]
    m = resolve_job_gpus(("MIG-11111111-2222-3333-4444-555555555555", "GPU-BBBBBBBB-0000-0000-0000-000000000000"),
                         gpus)
    assert m.indices == (0, 1) and not m.unmapped
    assert resolve_job_gpus(("MIG-GPU-aaaa/1/0",), gpus).indices == (0,)  # the R450-era MIG form


def test_mig_gres_index_is_not_guessed():
    gpus = [GpuInfo(index=i, minor_number=i, mig_enabled=True) for i in range(8)]
    m = resolve_job_gpus(("12",), gpus)
    assert m.indices == () and m.unmapped == ("12",) and "MIG GRES index" in m.notes[0]
    m = resolve_job_gpus(("3",), gpus)  # 3 exists as an NVML index, but with MIG on it is not that GPU
    assert m.indices == () and m.unmapped == ("3",)


@pytest.mark.parametrize("value,expected", [
    ("0,1,5", ("0", "1", "5")), ("0-3", ("0", "1", "2", "3")), ("", ()),
    ("MIG-11111111-2222-3333-4444-555555555555", ("MIG-11111111-2222-3333-4444-555555555555",)),
    ("GPU-82193ff9-1ab1-725b-2261-60b4414f5176,GPU-82193ff9-1ab1-725b-2261-60b4414f5177",
     ("GPU-82193ff9-1ab1-725b-2261-60b4414f5176", "GPU-82193ff9-1ab1-725b-2261-60b4414f5177")),
])
def test_parse_gpu_ids(value, expected):
    assert parse_gpu_ids(value) == expected


@pytest.mark.parametrize("bad", ["$(reboot)", "GPU-x;rm", "0,a", "MIG-../../etc", "1-2-3"])
def test_hostile_gpu_ids_are_dropped(bad):
    with pytest.raises(ValueError):
        parse_gpu_ids(bad)
    ctx = context_from_env("prolog", {"SLURM_JOB_ID": "5", "SLURM_JOB_GPUS": bad, "SLURMD_NODENAME": "n1"})
    assert "SLURM_JOB_GPUS" in ctx.ignored_env and ctx.gpu_ids == ()


def test_uuid_list_wins_over_indices():
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_GPUS": "12", "SLURMD_NODENAME": "n1",
           "CUDA_VISIBLE_DEVICES": "MIG-11111111-2222-3333-4444-555555555555"}
    ctx = context_from_env("prolog", env)
    assert ctx.gpu_ids == ("MIG-11111111-2222-3333-4444-555555555555",) and ctx.gpu_indices is None


# --------------------------------------------------------------------------- whole prolog runs


def _prolog(tmp_path, body, gpus_env):
    from gpuguard.context import RunContext

    scen = write_scenario(tmp_path, "s", body)
    ids = parse_gpu_ids(gpus_env)
    ctx = RunContext(kind="prolog", node="n1", job_id="9", gpu_ids=ids,
                     gpu_indices=tuple(int(i) for i in ids) if all(i.isdigit() for i in ids) else None)
    slurm = MemorySlurm()
    return run_sim(ctx, make_cfg(tmp_path), simulate=scen, slurm_client=slurm), slurm


def test_mig_index_12_does_not_drain_a_node(tmp_path):
    body = {"gpus": {"defaults": {"mig_enabled": True, "row_remap_supported": False}}}
    result, slurm = _prolog(tmp_path, body, "12")
    assert result.verdict.outcome == "warn" and not slurm.calls, result.verdict.reason
    f = next(f for f in result.findings if f.check_id == "gpu.count" and f.severity is Severity.WARN)
    assert "Slurm GPU id 12 matches no GPU" in f.message


def test_mig_job_maps_to_its_parent_gpu(tmp_path):
    mig = "MIG-11111111-2222-3333-4444-555555555555"
    body = {"gpus": {"overrides": {5: {"mig_enabled": True, "mig_devices": [mig],
                                       "processes": [{"pid": 4242, "used_mib": 3000}]}}}}
    result, slurm = _prolog(tmp_path, body, mig)
    assert result.context.gpu_indices == (5,)
    assert result.verdict.outcome == "drain" and "GPUPROC" in slurm.calls[0][1]  # GPU 5's leftover is the job's


def test_node_fault_outside_the_job_drains_the_node_in_any_prolog(tmp_path):
    """A row-remap failure on GPU 7 is a node fault: a 1-GPU job on GPU 0 must see it like an 8-GPU job does."""
    body = {"gpus": {"overrides": {7: {"remap_failure": True}}}}
    small, slurm = _prolog(tmp_path, body, "0")
    assert small.verdict.outcome == "drain" and "ROWREMAP" in slurm.calls[0][1]
    (tmp_path / "b").mkdir()
    big, _ = _prolog(tmp_path / "b", body, "0-7")
    assert big.verdict.reason.split(" [")[0] == small.verdict.reason.split(" [")[0]


def test_other_jobs_busy_gpus_are_not_judged_for_clocks_or_processes(tmp_path):
    body = {"gpus": {"overrides": {6: {"throttle": ["hw_thermal"], "processes": [{"pid": 4243, "used_mib": 70000}],
                                       "temperature_c": 84, "utilization_pct": 100}}}}
    result, slurm = _prolog(tmp_path, body, "0,1")
    assert result.verdict.outcome == "pass" and not slurm.calls, [f.message for f in result.findings
                                                                  if f.severity is not Severity.OK]


def test_mig_gpu_still_gets_row_remap_judged(tmp_path):
    """Row remapping lives on the physical GPU: a MIG-partitioned GPU with a pending remap needs a reset like any
    other (read through the parent handle, which is what the probe always reads)."""
    mig = "MIG-11111111-2222-3333-4444-555555555555"
    body = {"gpus": {"defaults": {"mig_enabled": True},
                     "overrides": {2: {"mig_devices": [mig], "remap_pending": True, "remap_uncorrectable": 1}}}}
    result, slurm = _prolog(tmp_path, body, mig)
    assert result.verdict.outcome == "drain" and "ROWREMAP" in slurm.calls[0][1]
    assert result.verdict.action.value == "reset"
