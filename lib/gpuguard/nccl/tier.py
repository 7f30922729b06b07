"""When the optional (slow) tier runs in a prolog: a pure decision, so the fast tier stays fast.

The optional tier (single-node all_reduce, `dcgmi diag -r N`, EFA counter deltas) takes seconds to minutes and
needs every GPU of the node idle, so it runs only when

- `nccl.tier_enabled` is true, and
- the job has the node to itself (`nccl.only_exclusive`): Slurm 22.05 gives the prolog no SLURM_JOB_EXCLUSIVE
  (verified, see devcluster.py), so "exclusive" is taken as "the job was given every GPU of the node"
  (SLURM_JOB_GPUS covers the profile's GPU count): then no other job can be on those GPUs, which is what the
  test needs. A newer Slurm that sets SLURM_JOB_EXCLUSIVE is honoured as given; and
- it is due: with `nccl.first_job_after_reboot` once per boot (the first eligible job after a reboot, when a
  replaced part or a driver update is most likely to be wrong), plus again every `nccl.tier_interval_h`
  hours when that is > 0; without it, on every eligible job.

The last run is a store cursor (`cursor_name(node)`: {"boot_id", "ts"}), written by the runner after the tier
ran (whatever its verdict: a failing node is drained anyway, and retrying on every job would only slow jobs).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from gpuguard.config.sections.nccl import NcclConfig
from gpuguard.probes.efa_counters import EfaCounterObservation, read_efa_counters

CURSOR_PREFIX = "nccl_tier:"


def cursor_name(node: str) -> str:
    return f"{CURSOR_PREFIX}{node}"


def job_is_exclusive(exclusive_env: Optional[bool], job_gpus: Optional[Sequence[int]],
                     node_gpu_count: Optional[int]) -> bool:
    """SLURM_JOB_EXCLUSIVE when Slurm gives it, else: the job holds every GPU of the node."""
    if exclusive_env is not None:
        return bool(exclusive_env)
    if job_gpus is None or not node_gpu_count:
        return False
    return len(set(job_gpus)) >= node_gpu_count


def tier_due(cfg: NcclConfig, *, kind: str, exclusive: bool, boot_id: Optional[str],
             last: Optional[Mapping[str, Any]], now: float) -> tuple[bool, str]:
    """(run the optional tier?, why). `cfg` is the `nccl` config section; `last` the tier cursor."""
    if not cfg.tier_enabled:
        return False, "optional tier disabled (nccl.tier_enabled)"
    if kind not in ("prolog", "manual"):
        return False, f"optional tier does not run in the {kind}"
    if cfg.only_exclusive and not exclusive:
        return False, "job does not have the whole node (nccl.only_exclusive)"
    if not cfg.first_job_after_reboot:
        return True, "every exclusive job (nccl.first_job_after_reboot: false)"
    if not last or not last.get("boot_id"):
        return True, "first job seen on this node"
    if boot_id and last.get("boot_id") != boot_id:
        return True, "first job after a reboot"
    interval_h = float(cfg.tier_interval_h or 0)
    ts = last.get("ts")
    if interval_h > 0 and isinstance(ts, (int, float)) and now - ts >= interval_h * 3600:
        return True, f"last optional tier more than {interval_h:g}h ago"
    return False, "already ran since this boot"


def tier_cursor(boot_id: Optional[str], now: float) -> dict[str, Any]:
    return {"boot_id": boot_id, "ts": now}


# --------------------------------------------------------------------------- wiring helpers for the runner

ProbeEntry = tuple[str, Callable[[], Any], float, type]


def tier_probes(nccl_cfg: NcclConfig, *, needs: set[str], gpus: int, sysfs_root: str = "/sys",
                boot_id: Optional[str] = None, efa_previous: Optional[Mapping[str, Any]] = None,
                env: Optional[Mapping[str, str]] = None, binary: Optional[str] = None,
                dcgmi: Optional[str] = None) -> list[ProbeEntry]:
    """(probe name, zero-argument callable, timeout_s, observation class for a timed-out result) for each of
    "nccl", "dcgm", "efa_counters" in `needs`: what gpuguard.pipeline.gather wraps in its Probe. `binary` / `dcgmi`
    override the config's tools (simulation: gpuguard.simulate.sources). Nothing heavy is imported here."""
    # the NCCL and DCGM probes only when the slow tier runs: this module is on every hook's path (tier_due, and
    # the health check's EFA counter deltas), those probes (and the NCCL parser's YAML) are not
    out: list[ProbeEntry] = []
    if "nccl" in needs:
        from gpuguard.nccl.probe import NcclObservation, run_single_node_nccl

        exe = binary or str(nccl_cfg.binary or "all_reduce_perf")
        fallback = "torch" if nccl_cfg.fallback == "torch" else None
        t = float(nccl_cfg.timeout_s)
        out.append(("nccl", lambda: run_single_node_nccl(
            exe, gpus=gpus, timeout_s=t, min_bytes=int(nccl_cfg.min_bytes), max_bytes=int(nccl_cfg.max_bytes),
            iterations=int(nccl_cfg.iterations), fallback=fallback, env=env), t + 2.0, NcclObservation))
    tool = dcgmi or nccl_cfg.dcgmi
    if "dcgm" in needs and tool:
        from gpuguard.probes.dcgm import DcgmObservation, run_dcgm_diag

        t = float(nccl_cfg.dcgm_timeout_s)
        level = int(nccl_cfg.dcgm_level)
        out.append(("dcgm", lambda: run_dcgm_diag(str(tool), level=level, timeout_s=t), t + 2.0, DcgmObservation))
    if "efa_counters" in needs:
        prev = dict(efa_previous) if efa_previous else None
        out.append(("efa_counters", lambda: read_efa_counters(sysfs_root, prev, boot_id=boot_id), 5.0,
                    EfaCounterObservation))
    return out

