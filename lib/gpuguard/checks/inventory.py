"""Configuration versus hardware, from the node's own history.

A count or link property below the profile is not by itself a fault: a p5 launched with 4 of its 32 EFA interfaces
(or none, for single-node work), GPUs whose PCIe links never train above Gen4 in this chassis, are the platform's
norm on every node, and draining for them drains the fleet. What is a fault is a device or link *this node had*
and has lost. So the checks that count (fabric.efa, fabric.ib, gpu.nvlink, gpu.pcie under load) compare with the
node's remembered inventory, the most it was ever seen with:

- below the profile and never more on this node: warn (evidence launch_choice=True; first_seen=True on the run that
  first records it, so a notification goes out once);
- below what this node had: the device or link disappeared, a hardware fault: fail.

Pure functions. The remembered inventory comes in as `Observations.previous["inventory"]` (the pipeline loads it from
the store, like `previous["pcie_replay"]`), and `update_inventory` gives the new one to save after the run.
Shape: {"efa": n, "ib": n, "nvlinks": {gpu: n}, "pcie": {gpu: [gen, width]}, "gpu_pci": {pci: "index"}}; gpu = UUID
(index when none).
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Mapping, Optional

from gpuguard.checks._util import fail, warn
from gpuguard.util.pci import pci_key
from gpuguard.model import Action, FabricObservation, Finding, GpuInfo, Observations, RdmaDevice

if TYPE_CHECKING:
    from gpuguard.checks.spec import CheckSpec
    from gpuguard.profiles import Profile

PREVIOUS_KEY = "inventory"  # in Observations.previous
GPU_IDLE = 0x1  # nvmlClocksEventReasonGpuIdle
DEFAULT_BUSY_UTIL_PCT = 5.0


def gpu_key(g: GpuInfo) -> str:
    return g.uuid or str(g.index)


def remembered(obs: Observations) -> dict[str, Any]:
    """The most this node was ever seen with, before this run ({} when nothing is remembered)."""
    prev = (obs.previous or {}).get(PREVIOUS_KEY)
    return prev if isinstance(prev, dict) else {}


def known_pci(obs: Observations) -> dict[str, Any]:
    """{PCI address (pci_key): GPU index} of the GPUs this node had in earlier runs (a GPU fallen off the bus is
    missing from NVML, not from here)."""
    known = remembered(obs).get("gpu_pci")
    return dict(known) if isinstance(known, dict) else {}


def _count(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def had_count(obs: Observations, item: str) -> Optional[int]:
    """The remembered device count of `item` (efa | ib); None when unknown (or unusable: a store written by hand)."""
    return _count(remembered(obs).get(item))


def had_nvlinks(obs: Observations, g: GpuInfo) -> Optional[int]:
    per_gpu = remembered(obs).get("nvlinks")
    return _count(per_gpu.get(gpu_key(g))) if isinstance(per_gpu, dict) else None


def had_pcie(obs: Observations, g: GpuInfo) -> Optional[tuple[int, int]]:
    """(generation, width) this GPU trained to under load before, at most."""
    per_gpu = remembered(obs).get("pcie")
    link = per_gpu.get(gpu_key(g)) if isinstance(per_gpu, dict) else None
    if isinstance(link, list) and len(link) == 2 and all(_count(x) is not None for x in link):
        return link[0], link[1]
    return None


def efa_devices(fab: FabricObservation) -> list[RdmaDevice]:
    return [d for d in fab.devices if d.kind == "efa"]


def ib_devices(fab: FabricObservation, profile: "Profile") -> list[RdmaDevice]:
    """The compute HCAs fabric.ib counts: the profile's names, else its name pattern (storage ports on the same
    node may be legitimately uncabled)."""
    names = profile.ib_compute_devices
    if names:
        return [d for d in fab.devices if d.kind == "ib" and d.name in names]
    pattern = profile.ib_device_pattern or "*"
    return [d for d in fab.devices if d.kind == "ib" and fnmatch.fnmatch(d.name, pattern)]


def gpu_busy(g: GpuInfo, min_util_pct: float = DEFAULT_BUSY_UTIL_PCT) -> bool:
    """Is the GPU working right now? Its link only shows what it trained to under load: at idle the driver may drop
    the link generation, and the width too (nvidia-smi's documentation says so for both). On a real H100 SXM the
    idle sample shows clock event reason 0x1 (GPU idle) and the loaded one 0x0 at 99-100 % utilisation."""
    if g.clock_event_reasons is not None and g.clock_event_reasons & GPU_IDLE:
        return False
    if g.utilization_gpu_pct is not None:
        return g.utilization_gpu_pct >= min_util_pct
    return False


def inventory(obs: Observations, profile: "Profile") -> dict[str, Any]:
    """What this run saw: device counts from a complete fabric read, NVLinks per GPU whose every state NVML gave,
    and each busy GPU's trained PCIe link."""
    out: dict[str, Any] = {}
    fab = obs.fabric
    if fab is not None and fab.devices_read:
        out["efa"] = len(efa_devices(fab))
        out["ib"] = len(ib_devices(fab, profile))
    if obs.nvml is not None:
        nvlinks: dict[str, int] = {}
        pcie: dict[str, list[int]] = {}
        # where each GPU sits (index as text: the newest mapping wins, never the larger number)
        addresses = {pci_key(g.pci_bus_id): str(g.index) for g in obs.nvml.gpus if g.pci_bus_id}
        if addresses:
            out["gpu_pci"] = addresses
        for g in obs.nvml.gpus:
            if g.fatal_error is not None:
                continue
            if g.nvlink_active is not None and None not in g.nvlink_active:
                nvlinks[gpu_key(g)] = len(g.nvlink_active)
            if gpu_busy(g) and g.pcie_gen_current and g.pcie_width_current:
                pcie[gpu_key(g)] = [g.pcie_gen_current, g.pcie_width_current]
        if nvlinks:
            out["nvlinks"] = nvlinks
        if pcie:
            out["pcie"] = pcie
    return out


def _merge(old: Any, new: Any) -> Any:
    if isinstance(new, dict):
        base = dict(old) if isinstance(old, dict) else {}
        for k, v in new.items():
            base[k] = _merge(base.get(k), v)
        return base
    if isinstance(new, list):
        if isinstance(old, list) and len(old) == len(new) and all(_count(x) is not None for x in old):
            return [max(a, b) for a, b in zip(old, new)]
        return list(new)
    return max(old, new) if _count(old) is not None and _count(new) is not None else new


def update_inventory(previous: Optional[Mapping[str, Any]], obs: Observations,
                     profile: "Profile") -> Optional[dict[str, Any]]:
    """The remembered inventory after this run (the most ever seen of each), or None when nothing changed."""
    prev = dict(previous) if isinstance(previous, Mapping) else {}
    new = _merge(prev, inventory(obs, profile))
    return new if new != prev else None


def count_finding(spec: "CheckSpec", what: str, seen: int, expected: int, had: Optional[int], remediation: str,
                  action: Action = Action.DRAIN, gpu: Optional[int] = None, **evidence: Any) -> Optional[Finding]:
    """`seen` below the profile's `expected`: a fault when this node had more (`had`, the remembered count), else
    the platform's norm (a launch or configuration choice): a warning, first_seen on the run that records it."""
    if seen >= expected:
        return None
    ev = {"expected": expected, "found": seen, "had": had, **evidence}
    head = f"{expected} {what} expected, {seen} found"
    if had is not None and seen < had:
        return fail(spec, f"{head}: {had - seen} gone (this node had {had})", remediation, action, gpu=gpu, **ev)
    return warn(spec, f"{head}: this node never had more (a launch or configuration choice, not a lost device)",
                "if this node type should have them, fix the launch template / cabling; if not, set the profile "
                "(node.overrides)", gpu=gpu, launch_choice=True, first_seen=had is None, **ev)
