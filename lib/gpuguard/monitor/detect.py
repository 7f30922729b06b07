"""Pure judgements over samples and the other nodes' reports: thresholds, stragglers, hangs. No I/O, no clock
(the caller passes `now`). Each node only ever judges itself (its GPUs, its node): 500 nodes comparing with each
other produce one alert about the straggler, sent by the straggler, not 499."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from gpuguard.config.sections.monitor import MonitorConfig
from gpuguard.monitor.sampler import GpuSample, HostSample, throttle_names


@dataclass
class Alert:
    kind: str  # straggler | hang | resource
    check_id: str  # monitor.gpu_clock, monitor.gpu_throttle, monitor.gpu_util, monitor.step_time, monitor.progress,
    #                monitor.gpu_idle, monitor.cpu, monitor.memory, monitor.disk, monitor.gpu_temp, monitor.gpu_power,
    #                monitor.gpu_memory, monitor.ecc
    severity: str  # critical | warning
    message: str
    gpu: Optional[int] = None
    evidence: dict[str, Any] = field(default_factory=dict)
    action: Optional[str] = None
    scope: str = "node"  # node | job (a job-wide condition every node sees: one node claims it)

    @property
    def key(self) -> str:
        return f"{self.check_id}:{'' if self.gpu is None else self.gpu}"


# --------------------------------------------------------------------------- thresholds


def host_alerts(h: HostSample, p: MonitorConfig) -> list[Alert]:
    """Instantaneous breaches; the loop only alerts once one has lasted `sustain_s`."""
    out = []
    if p.cpu_percent_max is not None and h.cpu_pct is not None and h.cpu_pct > p.cpu_percent_max:
        out.append(Alert("resource", "monitor.cpu", "warning",
                         f"CPU {h.cpu_pct:.0f}% busy (threshold {p.cpu_percent_max:g}%)",
                         evidence={"cpu_pct": h.cpu_pct},
                         action="data loader workers or a runaway process may starve the training ranks: check "
                                "`top` on the node and the num_workers setting"))
    if p.memory_percent_max is not None and h.mem_pct is not None and h.mem_pct > p.memory_percent_max:
        out.append(Alert("resource", "monitor.memory", "warning",
                         f"host memory {h.mem_pct:.0f}% used, {h.mem_available_mib} MiB available "
                         f"(threshold {p.memory_percent_max:g}%)",
                         evidence={"mem_pct": h.mem_pct, "available_mib": h.mem_available_mib},
                         action="the OOM killer may end the job: reduce data loader workers / pinned memory"))
    if p.disk_percent_max is not None:
        for path, pct in sorted(h.disk_used_pct.items()):
            if pct > p.disk_percent_max:
                out.append(Alert("resource", f"monitor.disk:{path}", "warning",
                                 f"{path} {pct:.0f}% full (threshold {p.disk_percent_max:g}%)",
                                 evidence={"path": path, "used_pct": pct},
                                 action=f"free space on {path} (checkpoints, core dumps, caches) before writes fail"))
    return out


def gpu_alerts(gpus: list[GpuSample], ecc_baseline: dict[int, int], p: MonitorConfig) -> list[Alert]:
    out = []
    for g in gpus:
        limit = p.gpu_temp_max_c
        if limit is None and g.temp_slowdown_c:
            limit = g.temp_slowdown_c - 5
        if limit is not None and g.temp_c is not None and g.temp_c >= limit:
            out.append(Alert("resource", "monitor.gpu_temp", "warning",
                             f"GPU {g.index} at {g.temp_c} C (limit {limit:g} C)", g.index,
                             {"temp_c": g.temp_c, "slowdown_c": g.temp_slowdown_c},
                             "check the node's fans and airflow; the GPU will throttle"))
        if p.gpu_power_max_w is not None and g.power_w is not None and g.power_w > p.gpu_power_max_w:
            out.append(Alert("resource", "monitor.gpu_power", "warning",
                             f"GPU {g.index} drawing {g.power_w:.0f} W (limit {p.gpu_power_max_w:g} W)", g.index,
                             {"power_w": g.power_w}))
        if p.gpu_memory_percent_max is not None and g.mem_used_mib is not None and g.mem_total_mib:
            pct = 100.0 * g.mem_used_mib / g.mem_total_mib
            if pct > p.gpu_memory_percent_max:
                out.append(Alert("resource", "monitor.gpu_memory", "warning",
                                 f"GPU {g.index} memory {pct:.0f}% used", g.index,
                                 {"used_mib": g.mem_used_mib, "total_mib": g.mem_total_mib}))
        if g.ecc_uncorrected is not None:
            gained = g.ecc_uncorrected - ecc_baseline.get(g.index, g.ecc_uncorrected)
            if gained > p.ecc_uncorrected_max:
                out.append(Alert("resource", "monitor.ecc", "critical",
                                 f"GPU {g.index}: {gained} new uncorrectable ECC error(s) during the job", g.index,
                                 {"volatile_uncorrected": g.ecc_uncorrected, "gained": gained},
                                 "the job's results on this GPU are suspect: drain the node after the job "
                                 "(`gpuguard check`); a GPU reset clears volatile counters"))
        bad = throttle_names(g.throttle_mask, only_bad=True)
        if p.throttle and bad:
            out.append(Alert("straggler", "monitor.gpu_throttle", "warning",
                             f"GPU {g.index} throttled ({', '.join(bad)}): SM clock {g.sm_clock_mhz} of "
                             f"{g.sm_clock_max_mhz} MHz", g.index,
                             {"throttle": bad, "sm_clock_mhz": g.sm_clock_mhz, "sm_clock_max_mhz": g.sm_clock_max_mhz,
                              "temp_c": g.temp_c, "power_w": g.power_w},
                             "the whole job runs at this GPU's pace: check cooling and power (`nvidia-smi -q -d "
                             "PERFORMANCE`); drain the node if it persists"))
    return out


# --------------------------------------------------------------------------- stragglers


def _busy(g: dict[str, Any], busy_pct: float) -> bool:
    return g.get("util_pct") is not None and g["util_pct"] >= busy_pct and bool(g.get("sm_clock_mhz"))


def straggler_alerts(me: dict[str, Any], peers: list[dict[str, Any]], p: MonitorConfig) -> list[Alert]:
    """Compare this node's report with the job's other nodes' (reports as written to the job directory)."""
    out: list[Alert] = []
    everyone = [me] + peers
    all_gpus = [g for r in everyone for g in r.get("gpus", [])]
    busy = [g for g in all_gpus if _busy(g, p.busy_util_pct)]
    if len(busy) >= 2:
        median_clock = statistics.median(g["sm_clock_mhz"] for g in busy)
        for g in me.get("gpus", []):
            if _busy(g, p.busy_util_pct) and g["sm_clock_mhz"] < p.straggler_clock_ratio * median_clock:
                out.append(Alert("straggler", "monitor.gpu_clock", "warning",
                                 f"GPU {g['index']} SM clock {g['sm_clock_mhz']} MHz is "
                                 f"{100 * g['sm_clock_mhz'] / median_clock:.0f}% of the job's median "
                                 f"{median_clock:g} MHz ({len(busy)} busy GPUs on {len(everyone)} node(s))",
                                 g["index"], {"sm_clock_mhz": g["sm_clock_mhz"], "job_median_mhz": median_clock,
                                              "throttle": throttle_names(g.get("throttle_mask"))},
                                 "the whole job waits for this GPU: check its cooling and power; drain the node "
                                 "after the job if it persists"))
    utils = [g["util_pct"] for g in all_gpus if g.get("util_pct") is not None]
    if len(utils) >= 2:
        median_util = statistics.median(utils)
        if median_util >= p.busy_util_pct:
            for g in me.get("gpus", []):
                u = g.get("util_pct")
                if u is not None and u < median_util - p.straggler_util_gap_pct:
                    out.append(Alert("straggler", "monitor.gpu_util", "warning",
                                     f"GPU {g['index']} {u}% busy vs the job's median {median_util:g}%",
                                     g["index"], {"util_pct": u, "job_median_pct": median_util},
                                     "this rank is starved (input pipeline, CPU, I/O) or stuck"))
    mine = me.get("step_time_s")
    others = [r["step_time_s"] for r in peers if r.get("step_time_s")]
    if mine and others:
        median_step = statistics.median(others)
        if mine > p.straggler_step_ratio * median_step:
            out.append(Alert("straggler", "monitor.step_time", "warning",
                             f"step time {mine:.3g} s vs the other nodes' median {median_step:.3g} s",
                             None, {"step_time_s": mine, "peers_median_s": median_step, "peers": len(others)},
                             "this node slows every step of the job: look for throttled GPUs, a slow NIC or a "
                             "noisy neighbour; exclude it on the next requeue"))
    return out


# --------------------------------------------------------------------------- hangs


def progress_hang(now: float, started: float, last_progress: Optional[float], last_iteration: Optional[int],
                  log_path: Optional[str], p: MonitorConfig) -> Optional[Alert]:
    """No new iteration in the training log for `hang_minutes` (`startup_minutes` before the first one)."""
    if not log_path:
        return None
    if last_progress is None:
        waited, limit = now - started, p.startup_minutes * 60
        what = "no training iteration logged yet"
    else:
        waited, limit = now - last_progress, p.hang_minutes * 60
        what = f"no new iteration since {last_iteration}"
    if waited < limit:
        return None
    return Alert("hang", "monitor.progress", "critical",
                 f"training stalled: {what} for {waited / 60:.1f} min (limit {limit / 60:g} min) in {log_path}",
                 None, {"log": log_path, "last_iteration": last_iteration, "stalled_s": round(waited)},
                 "look at the Python stack dumps (a collective waiting for a dead rank?), then cancel or requeue",
                 scope="job")


def idle_hang(now: float, idle_since: Optional[float], peers: list[dict[str, Any]],
              p: MonitorConfig) -> Optional[Alert]:
    """Every GPU of this node idle for `idle_minutes`; job-wide when every other node is idle too."""
    limit = p.idle_minutes * 60
    if idle_since is None or now - idle_since < limit:
        return None
    all_idle = bool(peers) and all(r.get("idle_since") is not None and now - r["idle_since"] >= limit for r in peers)
    scope = "job" if all_idle else "node"
    where = f"all {len(peers) + 1} nodes" if all_idle else "this node (others are busy)"
    return Alert("hang", "monitor.gpu_idle", "critical",
                 f"every GPU idle for {(now - idle_since) / 60:.1f} min on {where}",
                 None, {"idle_s": round(now - idle_since), "nodes_idle": len(peers) + 1 if all_idle else 1},
                 "the job is not computing: look at the stack dumps; cancel or requeue it", scope=scope)


# --------------------------------------------------------------------------- one page per GPU per cause

THERMAL_THROTTLE = frozenset({"hw_thermal", "sw_thermal", "hw_slowdown"})


def one_per_gpu_cause(alerts: list[Alert]) -> list[Alert]:
    """A hot GPU is one problem, not two pages: its thermal throttling is told inside the temperature alert; a
    throttled GPU's low clock (the job-wide straggler comparison) inside the throttle alert. Pure."""
    by_gpu: dict[tuple[int, str], Alert] = {(a.gpu, a.check_id): a for a in alerts if a.gpu is not None}
    dropped: set[int] = set()
    for (gpu, check), a in list(by_gpu.items()):
        if check != "monitor.gpu_throttle":
            continue
        temp = by_gpu.get((gpu, "monitor.gpu_temp"))
        reasons = set(a.evidence.get("throttle") or [])
        if temp is not None and reasons and reasons <= THERMAL_THROTTLE:
            temp.message += f"; throttling ({', '.join(sorted(reasons))})"
            temp.evidence = {**temp.evidence, "throttle": sorted(reasons), "sm_clock_mhz": a.evidence.get("sm_clock_mhz")}
            dropped.add(id(a))
            a = temp
        clock = by_gpu.get((gpu, "monitor.gpu_clock"))
        if clock is not None:
            a.message += f"; {clock.message}"
            a.evidence = {**a.evidence, "clock": clock.evidence}
            dropped.add(id(clock))
    return [a for a in alerts if id(a) not in dropped]
