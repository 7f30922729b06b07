"""The node's own inventory (issue 14, item 7): what a run saw, and the most the node was ever seen with, as pure
functions over observations (the runner keeps the remembered one in the store, like the PCIe replay baseline)."""

from __future__ import annotations

from gpuguard.checks.inventory import inventory, update_inventory
from gpuguard.model import (FabricObservation, FiInfo, GpuInfo, NvmlObservation, Observations, ProbeStatus, RdmaDevice,
                            RdmaPort)
from gpuguard.profiles import load_profile
from h100 import h100  # idle and healthy: 18 NVLinks, PCIe Gen5 x16

P5 = load_profile("p5.48xlarge")
DGX = load_profile("dgx-h100-ib")
BUSY = dict(clock_event_reasons=0, utilization_gpu_pct=99)  # a loaded H100 SXM: no idle reason, 99 % busy


def fabric(efa: int = 32, ib: tuple[str, ...] = (), complete: bool = True) -> FabricObservation:
    devs = [RdmaDevice(f"rdmap{16 + i}s27", "efa", [RdmaPort(1, "ACTIVE")]) for i in range(efa)]
    devs += [RdmaDevice(n, "ib", [RdmaPort(1, "ACTIVE")]) for n in ib]
    return FabricObservation(status=ProbeStatus(complete=complete), devices=devs,
                             fi_info=FiInfo(ran=True, provider_found=True, devices=efa))


def obs(*gpus: GpuInfo, fab: FabricObservation | None = None) -> Observations:
    return Observations(nvml=NvmlObservation(device_count=len(gpus), gpus=list(gpus)), fabric=fab)


def test_what_a_run_saw():
    o = obs(h100(0, **BUSY), h100(1), h100(2, nvlink_active=[True] * 17 + [None]), h100(3, fatal_error="GPU_IS_LOST"),
            fab=fabric(32, ib=("mlx5_0", "mlx5_1")))
    inv = inventory(o, P5)
    assert inv["efa"] == 32 and inv["ib"] == 2
    # GPU 2 has a link NVML could not read: its count is not known, so nothing is recorded for it
    assert inv["nvlinks"] == {"GPU-0": 18, "GPU-1": 18}
    assert inv["pcie"] == {"GPU-0": [5, 16]}  # only under load: an idle link may have dropped its generation


def test_ib_counts_only_the_profiles_compute_hcas():
    compute = list(DGX.ib_compute_devices)
    inv = inventory(obs(fab=fabric(0, ib=tuple(compute) + ("mlx5_1", "mlx5_2"))), DGX)
    assert inv["ib"] == len(compute)


def test_a_partial_fabric_read_counts_nothing():
    assert "efa" not in inventory(obs(fab=fabric(0, complete=False)), P5)
    timed_out = FabricObservation(status=ProbeStatus(complete=False, timed_out=True))
    assert inventory(obs(fab=timed_out), P5) == {}
    fi_failed = fabric(32, complete=False)
    fi_failed.devices_complete = True  # sysfs was read; only fi_info failed
    assert inventory(obs(fab=fi_failed), P5)["efa"] == 32


def test_the_node_remembers_the_most_it_was_ever_seen_with():
    first = update_inventory(None, obs(h100(0, **BUSY), fab=fabric(4)), P5)
    assert first == {"efa": 4, "ib": 0, "nvlinks": {"GPU-0": 18}, "pcie": {"GPU-0": [5, 16]},
                     "gpu_pci": {"0000:53:00": "0"}}  # where each GPU sits: names a GPU NVML lost (an Xid 79)
    assert update_inventory(first, obs(h100(0, **BUSY), fab=fabric(4)), P5) is None  # nothing new: nothing to save
    # fewer devices and a narrower link do not lower what the node had ...
    assert update_inventory(first, obs(h100(0, pcie_width_current=8, **BUSY), fab=fabric(3)), P5) is None
    # ... more do raise it, per GPU and per part of the link
    more = update_inventory(first, obs(h100(0, pcie_gen_current=4, **BUSY), h100(1), fab=fabric(32)), P5)
    assert more == {"efa": 32, "ib": 0, "nvlinks": {"GPU-0": 18, "GPU-1": 18}, "pcie": {"GPU-0": [5, 16]},
                    "gpu_pci": {"0000:53:00": "0", "0000:64:00": "1"}}
    assert first["efa"] == 4  # the input is not changed


def test_garbage_in_the_store_is_replaced_not_fatal():
    assert update_inventory("not a dict", obs(h100(0), fab=fabric(2)), P5) == {
        "efa": 2, "ib": 0, "nvlinks": {"GPU-0": 18}, "gpu_pci": {"0000:53:00": "0"}}
    assert update_inventory({"efa": "x", "nvlinks": [1], "gpu_pci": 7}, obs(h100(0), fab=fabric(2)), P5) == {
        "efa": 2, "ib": 0, "nvlinks": {"GPU-0": 18}, "gpu_pci": {"0000:53:00": "0"}}


def test_checks_ignore_an_unusable_remembered_inventory():
    """A hand-edited or damaged inventory in the store never crashes a check (it reads as "not remembered")."""
    from gpuguard.checks import CheckInput, get_check

    o = obs(h100(0, nvlink_active=[True] * 12, pcie_width_current=8, **BUSY), fab=fabric(28))
    o.previous = {"inventory": {"efa": "32", "nvlinks": {"GPU-0": None}, "pcie": {"GPU-0": ["5", 16]}}}
    for cid in ("fabric.efa", "gpu.nvlink", "gpu.pcie"):
        found = get_check(cid)(o, CheckInput(profile=P5))
        assert [f.severity.value for f in found if f.severity.value != "ok"] == ["warn"], (cid, found)
