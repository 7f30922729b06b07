"""Gather: every probe at once, each under its own deadline and all within the gather stage's share of the run.

Probes run in daemon threads: a hung GPU (NVML blocked in the driver) or a hung filesystem leaves an incomplete,
timed-out observation behind and the run goes on; the hook exits with os._exit, so a thread stuck in a C call
never keeps it alive. A probe that raises (even while being set up) is an incomplete observation too, never an
exception upward: the other probes' evidence still counts.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from gpuguard.checks import CheckSpec, probe_options
from gpuguard.config.core import DeadlinesConfig
from gpuguard.config.schema import Config
from gpuguard.context import RunContext
from gpuguard.kernellog.sources import read_xid_events
from gpuguard.model import FabricObservation, KernelLogObservation, NvmlObservation, ProbeStatus, SystemObservation
from gpuguard.pipeline.budget import Deadline
from gpuguard.pipeline.sources import Sources, read_boot_id
from gpuguard.probes.fabric import read_fabric
from gpuguard.probes.nvml import read_nvml
from gpuguard.probes.system import read_system
from gpuguard.profiles import Profile
from gpuguard.util.record import Record, record


@record
class Probe(Record):
    name: str
    fn: Callable[[], Any]
    timeout_s: float
    on_timeout: Callable[[str], Any]
    # a second wait before calling it a hang (NVML without persistence mode can take many seconds to start)
    grace_s: float = 0.0


def timed_out(cls: type, **extra: Any) -> Callable[[str], Any]:
    def make(msg: str) -> Any:
        obj = cls(status=ProbeStatus(complete=False, error=msg, timed_out=True))
        for k, v in extra.items():
            setattr(obj, k, v)
        return obj

    return make


def gather(probes: list[Probe], deadline: Deadline) -> dict[str, Any]:
    """Start every probe at once; collect each within its own deadline and the stage's."""
    boxes: dict[str, dict[str, Any]] = {}
    threads: dict[str, tuple[threading.Thread, float]] = {}
    for p in probes:
        box: dict[str, Any] = {}
        boxes[p.name] = box
        t = threading.Thread(target=_run_probe, args=(p, box), name=f"probe-{p.name}", daemon=True)
        t.start()
        threads[p.name] = (t, time.monotonic() + deadline.bound(p.timeout_s))
    out: dict[str, Any] = {}
    for p in probes:
        t, until = threads[p.name]
        t.join(max(0.0, until - time.monotonic()))
        late = False
        if t.is_alive() and p.grace_s and deadline.remaining() > 0:
            t.join(min(p.grace_s, deadline.remaining()))  # once more: slow is not hung
            late = not t.is_alive()
        out[p.name] = _collect(p, boxes[p.name], alive=t.is_alive(), late=late)
    return out


def _run_probe(p: Probe, box: dict[str, Any]) -> None:
    t0 = time.monotonic()
    try:
        box["value"] = p.fn()
    except BaseException as e:  # noqa: BLE001
        box["error"] = f"{type(e).__name__}: {e}"
    box["took"] = time.monotonic() - t0


def _collect(p: Probe, box: dict[str, Any], *, alive: bool, late: bool) -> Any:
    if alive:
        return p.on_timeout(f"{p.name} probe timed out after {p.timeout_s:g}s")
    if "error" in box:
        obs = p.on_timeout(f"{p.name} probe error: {box['error']}")
        status = getattr(obs, "status", None)
        if status is not None:
            status.timed_out = False
        return obs
    obs = box.get("value")
    status = getattr(obs, "status", None)
    if status is not None:
        status.duration_s = box.get("took", 0.0)
    if late and hasattr(obs, "slow_answer_s"):
        obs.slow_answer_s = box.get("took", 0.0)
    return obs


# --------------------------------------------------------------------------- which probes a plan needs


def build_probes(specs: list[CheckSpec], cfg: Config, ctx: RunContext, sources: Sources, profile: Profile,
                 kernel_cursor: Optional[dict[str, Any]], store: Any = None) -> list[Probe]:
    needs = {s.needs for s in specs}
    opts = probe_options(specs, cfg, profile)  # what the planned checks need each probe to read
    dl = cfg.deadlines
    probes: list[Probe] = []
    tier_needs = needs & {"nccl", "dcgm", "efa_counters"}
    if tier_needs:
        try:
            probes.extend(_tier_probes(tier_needs, cfg, ctx, sources, profile, store))
        except Exception as e:  # noqa: BLE001 - a tier that cannot even be set up is incomplete, not a crash
            probes.extend(_failed_tier_probes(tier_needs, f"{type(e).__name__}: {e}"))
    if "nvml" in needs:
        probes.append(_nvml_probe(bool(opts["nvml"].get("with_processes")), dl, sources, profile))
    if "kernel_log" in needs:
        probes.append(Probe("kernel_log", lambda: read_xid_events(
            sources.kernel_log, kernel_cursor, timeout_s=dl.kernel_log_s, boot_id_path=sources.boot_id_path,
            boot_id=sources.boot_id), dl.kernel_log_s + 0.5, timed_out(KernelLogObservation)))
    if "fabric" in needs:
        want_fi = bool(opts["fabric"].get("fi_info"))
        probes.append(Probe("fabric", lambda: read_fabric(
            sysfs_root=sources.sysfs_root, fi_info=sources.fi_info if want_fi else None,
            timeout_s=dl.fabric_s), dl.fabric_s + 0.5, timed_out(FabricObservation)))
    if "system" in needs:
        paths = list(opts["system"].get("disk_paths") or [])
        probes.append(Probe("system", lambda: read_system(paths, procfs_root=sources.procfs_root,
                                                          sysfs_root=sources.sysfs_root),
                            dl.system_s, timed_out(SystemObservation)))
    return probes


def _nvml_probe(want_procs: bool, dl: DeadlinesConfig, sources: Sources, profile: Profile) -> Probe:
    # every GPU of the node: node-level faults are judged on all of them whatever the job asked for, and Slurm's
    # GPU ids are mapped to NVML's afterwards (gpuguard.pipeline.gpumap)
    return Probe("nvml", lambda: read_nvml(
        gpu_indices=None, nvlinks=profile.nvlinks_per_gpu, library_path=sources.nvml_library,
        env=sources.nvml_env or None, with_processes=want_procs),
        dl.nvml_s, timed_out(NvmlObservation, init_error="TIMEOUT"), grace_s=dl.nvml_s)


def _tier_probes(tier_needs: set[str], cfg: Config, ctx: RunContext, sources: Sources, profile: Profile,
                 store: Any) -> list[Probe]:
    # here: only a plan with the optional tier (NCCL, DCGM, EFA counters) imports it, not every prolog
    from gpuguard.nccl.tier import tier_probes
    from gpuguard.probes.efa_counters import cursor_name as efa_cursor_name

    gpus = len(ctx.gpu_indices) if ctx.gpu_indices else (profile.gpu_count or 8)
    efa_prev = store.get_cursor(efa_cursor_name(ctx.node)) if store is not None else None
    return [Probe(name, fn, timeout, timed_out(cls))
            for name, fn, timeout, cls in tier_probes(
                cfg.nccl, needs=tier_needs, gpus=gpus, sysfs_root=sources.sysfs_root,
                boot_id=read_boot_id(sources), efa_previous=efa_prev, binary=sources.tools.get("all_reduce_perf"),
                dcgmi=sources.tools.get("dcgmi"))]


def _failed_tier_probes(tier_needs: set[str], error: str) -> list[Probe]:
    from gpuguard.nccl.probe import NcclObservation
    from gpuguard.probes.dcgm import DcgmObservation
    from gpuguard.probes.efa_counters import EfaCounterObservation

    classes = {"nccl": NcclObservation, "dcgm": DcgmObservation, "efa_counters": EfaCounterObservation}

    def fail() -> Any:
        raise RuntimeError(f"setting up the probe failed: {error}")

    return [Probe(name, fail, 1.0, timed_out(classes[name])) for name in sorted(tier_needs)]
