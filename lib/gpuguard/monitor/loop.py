"""The monitor's schedule: sample, report, compare, judge, act, sleep. Everything slow (notifications, stack
dumps, the requeue command) is bounded; a failing piece is logged and the loop goes on."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.siteconfig import load_config
from gpuguard.context import parse_gpu_list
from gpuguard.metrics.textfile import MONITOR_FILE, monitor_dir, remove, write_families
from gpuguard.monitor.detect import (Alert, gpu_alerts, host_alerts, idle_hang, one_per_gpu_cause, progress_hang,
                                     straggler_alerts)
from gpuguard.monitor.episodes import AlertEpisodes
from gpuguard.monitor.jobdir import JobDir
from gpuguard.monitor.log import log as _log
from gpuguard.monitor.metrics import monitor_families
from gpuguard.monitor.progress import LogFollower
from gpuguard.monitor.sampler import GpuSampler, HostSampler, self_cost, to_dict
from gpuguard.notify import flush, user_state_path
from gpuguard.simulate.sources import resolve_sources
from gpuguard.slurm.client import CliSlurmClient
from gpuguard.slurm.parse import parse_job_line


def resolve_train_log(setting: Optional[str], job_dir: str, job_id: Optional[str], node: str, cfg: Config) -> \
        Optional[str]:
    """`auto`: <job dir>/train.log when it exists, else the job's StdOut from `scontrol show job` (bounded)."""
    if not setting:
        return None
    if setting != "auto":
        return setting.replace("{job_dir}", job_dir).replace("{job_id}", job_id or "").replace("{node}", node)
    candidate = os.path.join(job_dir, "train.log")
    if os.path.exists(candidate) or not job_id:
        return candidate
    try:
        s = cfg.slurm
        client = CliSlurmClient(s.scontrol, cfg.deadlines.scontrol_s, s.conf)
        out = client.run(["show", "job", str(job_id), "-o"])
        stdout = parse_job_line(out.splitlines()[0]).get("StdOut") if out.strip() else None
        return stdout or candidate
    except Exception as e:  # noqa: BLE001 - no scontrol, job gone: fall back to the job dir
        _log(f"cannot ask Slurm for the job's output file ({e}); following {candidate}")
        return candidate


class Monitor(AlertEpisodes):
    """One node's sidecar: sample, report, compare with the other nodes, judge, act (alerts: AlertEpisodes)."""

    def __init__(self, cfg: Config, job_dir: str, node: str, job_id: Optional[str], interval_s: float,
                 gpus: Optional[list[int]] = None, train_log: Optional[str] = None) -> None:
        self.cfg = cfg
        self.p = cfg.monitor
        self.node, self.job_id, self.interval = node, job_id, interval_s
        self.jobdir = JobDir(job_dir)
        self.started = time.time()
        try:
            library, env = self._nvml_source()
            self.gpus = GpuSampler(gpus, library, env)
        except Exception as e:  # noqa: BLE001 - e.g. no scenario for this simulated node: sample the rest
            self.gpus = GpuSampler.unavailable(f"{type(e).__name__}: {e}")
        if self.gpus.init_error:
            _log(f"NVML: {self.gpus.init_error} (GPU sampling off; node sampling and hang detection go on)")
        self.host = HostSampler(list(dict.fromkeys(self.p.disk_paths + [job_dir])))
        log_path = resolve_train_log(train_log or self.p.train_log, job_dir, job_id, node, cfg)
        self.follower = LogFollower(log_path) if log_path else None
        self.last_progress: Optional[float] = None
        self.idle_since: Optional[float] = None
        self.ecc_baseline: dict[int, int] = {}
        self.first_seen: dict[str, float] = {}  # alert key -> when the condition started
        self.streak: dict[str, int] = {}  # alert key -> consecutive samples
        self.active: dict[str, Alert] = {}  # alerts of open episodes (reported once), by key
        self.clear_streak: dict[str, int] = {}  # alert key -> samples in a row its condition has been clear
        self.gpu_ids: dict[int, dict[str, Any]] = {}  # GPU index -> uuid, serial, pci_bus_id (for alerts)
        self.restart = os.environ.get("SLURM_RESTART_COUNT") or "0"  # a requeued job keeps its id and job dir
        if self.follower is not None and self.restart != "0":
            # a requeued attempt: the iterations its log already holds are the previous attempt's (Slurm appends to
            # the job's output file); until this attempt logs one, resuming (a checkpoint load) is start-up, judged
            # against startup_minutes, not a hang
            self.follower.poll()
        self.hang_claim: Optional[str] = None
        self.hang_label: Optional[str] = None
        self.py_spy_missing_told = False
        # the monitor runs as the job's user: its notification state is its own (never the hooks' store)
        self.notify_state = user_state_path(cfg, job_dir, job_id, node)
        self.peers: dict[str, dict[str, Any]] = {}
        self.samples = 0
        self.last_flush = 0.0
        # other nodes' reports are read every 3rd sample (30 s at the default interval): metadata load on a shared fs
        self.peer_every = max(1, min(3, round(30.0 / interval_s)))
        self.cost_start = (time.monotonic(), *self_cost())

    def _nvml_source(self) -> tuple[Optional[str], Optional[dict[str, str]]]:
        sim = self.cfg.simulation
        if sim.scenario or sim.scenario_dir:  # simulated node: the fake NVML and its scenario
            sources = resolve_sources(self.cfg, self.node)
            return sources.nvml_library, sources.nvml_env
        return self.cfg.sources.nvml_library, None

    # ------------------------------------------------------------------ one sample
    def step(self, now: Optional[float] = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        gpus = self.gpus.sample() if not self.gpus.init_error else []
        host = self.host.sample()
        for g in gpus:
            if g.ecc_uncorrected is not None:
                self.ecc_baseline.setdefault(g.index, g.ecc_uncorrected)
        if self.follower is not None and self.follower.poll():
            self.last_progress = now
        idle = bool(gpus) and all(g.util_pct is not None and g.util_pct <= self.p.idle_util_pct for g in gpus)
        self.idle_since = (self.idle_since or now) if idle else None
        cpu_s, rss = self_cost()
        report = {
            "node": self.node, "job_id": self.job_id, "ts": now, "interval_s": self.interval,
            "gpus": [{k: v for k, v in to_dict(g).items() if k != "errors"} for g in gpus],
            "host": to_dict(host), "idle_since": self.idle_since,
            "step_time_s": self.follower.step_time_s() if self.follower else None,
            "last_iteration": self.follower.last.iteration if self.follower and self.follower.last else None,
            "last_progress": self.last_progress, "train_log": self.follower.path if self.follower else None,
            "nvml_error": self.gpus.init_error, "monitor_cpu_s": round(cpu_s, 3), "monitor_rss_bytes": rss,
        }
        try:
            self.jobdir.write_report(self.node, report)
            if self.samples % self.peer_every == 0:
                stale = max(3 * self.interval, 60.0)
                self.peers = {n: r for n, r in self.jobdir.read_reports(stale, now).items() if n != self.node}
        except OSError as e:
            _log(f"job directory {self.jobdir.root}: {e}")
        self.samples += 1

        alerts = self._judge(now, gpus, host, report)
        fired = self._fire(now, alerts)
        resolved = self._resolve(now, {a.key for a in alerts})
        self._write_metrics(report, alerts)
        if now - self.last_flush > 60:
            self.last_flush = now
            flush(self.cfg, budget_s=2.0, state_path=self.notify_state)
        report["alerts"] = [a.__dict__ for a in alerts]
        report["fired"] = fired
        report["resolved"] = resolved
        return report

    def _judge(self, now: float, gpus: list[Any], host: Any, report: dict[str, Any]) -> list[Alert]:
        p = self.p
        raw_host = host_alerts(host, p)
        raw_gpu = gpu_alerts(gpus, self.ecc_baseline, p) + straggler_alerts(report, list(self.peers.values()), p)
        # node thresholds must hold for sustain_s (CloudWatch-style alarms); stragglers for N samples in a row
        self.first_seen = {a.key: self.first_seen.get(a.key, now) for a in raw_host}
        self.streak = {a.key: self.streak.get(a.key, 0) + 1 for a in raw_gpu}
        alerts = [a for a in raw_host if now - self.first_seen[a.key] >= p.sustain_s]
        alerts += [a for a in raw_gpu if a.kind != "straggler" or self.streak[a.key] >= p.straggler_samples]
        alerts += [a for a in (progress_hang(now, self.started, self.last_progress, report["last_iteration"],
                                             report["train_log"], p),
                               idle_hang(now, self.idle_since, list(self.peers.values()), p)) if a is not None]
        return one_per_gpu_cause(alerts)

    def _write_metrics(self, report: dict[str, Any], alerts: list[Alert]) -> None:
        directory = monitor_dir(self.cfg, self.node)
        if not directory:
            return
        try:
            write_families(directory, "monitor", monitor_families(report, alerts, self.cost()))
        except Exception as e:  # noqa: BLE001
            _log(f"metrics: {type(e).__name__}: {e}")

    def cost(self) -> dict[str, float]:
        t0, cpu0, _ = self.cost_start
        cpu, rss = self_cost()
        wall = max(1e-6, time.monotonic() - t0)
        return {"cpu_pct_of_one_core": 100.0 * (cpu - cpu0) / wall, "rss_bytes": float(rss)}

    def close(self) -> None:
        self.gpus.close()
        # on every exit (end of --duration, SIGTERM/SIGINT from srun or scancel, --once): a file left behind would
        # show the GPUs' last values, and the job's alerts, as current for ever
        directory = monitor_dir(self.cfg, self.node)
        if directory:
            remove(directory, MONITOR_FILE)


def main_from_args(args: Any) -> int:
    cfg = load_config(args.config)
    p = cfg.monitor
    node = args.node or cfg.node.name or os.environ.get("SLURMD_NODENAME") or \
        socket.gethostname().split(".")[0]
    job_id = args.job_id or os.environ.get("SLURM_JOB_ID")
    interval = args.interval or p.interval_s
    if interval <= 0:
        print("gpuguard monitor: --interval must be > 0", file=sys.stderr)
        return 2
    gpus = list(parse_gpu_list(args.gpus)) if args.gpus else None
    try:
        os.makedirs(args.job_dir, exist_ok=True)
        mon = Monitor(cfg, args.job_dir, node, job_id, interval, gpus, args.train_log)
    except OSError as e:
        print(f"gpuguard monitor: job directory {args.job_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    if args.once:
        print(json.dumps(mon.step(), indent=2, default=str))
        mon.close()
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())  # srun/scancel end the sidecar with SIGTERM: exit cleanly
    _log(f"monitoring node {node} job {job_id} every {interval:g}s, {len(mon.gpus.handles)} GPU(s), "
         f"training log {mon.follower.path if mon.follower else '-'}")
    end = time.monotonic() + args.duration if args.duration else None
    while not stop.is_set() and (end is None or time.monotonic() < end):
        t0 = time.monotonic()
        try:
            mon.step()
        except Exception as e:  # noqa: BLE001 - one bad sample must not end monitoring of a multi-day job
            _log(f"sample failed: {type(e).__name__}: {e}")
        stop.wait(max(0.0, interval - (time.monotonic() - t0)))
    if stop.is_set():  # SIGTERM/SIGINT: the job is ending (or was cancelled/requeued)
        mon.resolve_all("no longer monitored: the job ended")
    c = mon.cost()
    _log(f"stopping after {mon.samples} samples; cost {c['cpu_pct_of_one_core']:.2f}% of one core, "
         f"RSS {c['rss_bytes'] / 2**20:.1f} MiB")
    mon.close()
    return 0
