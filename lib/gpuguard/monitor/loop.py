"""The monitor's schedule: sample, report, compare, judge, act, sleep. Everything slow (notifications, stack
dumps, the requeue command) is bounded; a failing piece is logged and the loop goes on."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.monitor.detect import (Alert, gpu_alerts, host_alerts, idle_hang, one_per_gpu_cause, progress_hang,
                                     straggler_alerts)
from gpuguard.monitor.jobdir import JobDir
from gpuguard.monitor.progress import LogFollower
from gpuguard.monitor.sampler import GpuSampler, HostSampler, self_cost, to_dict


def _log(msg: str) -> None:
    # the monitor's stderr lands in the job's output: users see what it saw
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} gpuguard-monitor: {msg}\n")
    sys.stderr.flush()


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
        from gpuguard.slurm.client import CliSlurmClient
        from gpuguard.slurm.parse import parse_job_line

        s = cfg.sections["slurm"]
        client = CliSlurmClient(s["scontrol"], cfg.sections["deadlines"]["scontrol_s"], s["conf"])
        out = client.run(["show", "job", str(job_id), "-o"])
        stdout = parse_job_line(out.splitlines()[0]).get("StdOut") if out.strip() else None
        return stdout or candidate
    except Exception as e:  # noqa: BLE001 - no scontrol, job gone: fall back to the job dir
        _log(f"cannot ask Slurm for the job's output file ({e}); following {candidate}")
        return candidate


class Monitor:
    def __init__(self, cfg: Config, job_dir: str, node: str, job_id: Optional[str], interval_s: float,
                 gpus: Optional[list[int]] = None, train_log: Optional[str] = None) -> None:
        self.cfg = cfg
        self.p = cfg.sections["monitor"]
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
        self.host = HostSampler(list(dict.fromkeys(self.p["disk_paths"] + [job_dir])))
        log_path = resolve_train_log(train_log or self.p["train_log"], job_dir, job_id, node, cfg)
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
        self.hang_claim: Optional[str] = None
        from gpuguard.notify import user_state_path

        # the monitor runs as the job's user: its notification state is its own (never the hooks' store)
        self.notify_state = user_state_path(cfg, job_dir, job_id, node)
        self.peers: dict[str, dict[str, Any]] = {}
        self.samples = 0
        self.last_flush = 0.0
        # other nodes' reports are read every 3rd sample (30 s at the default interval): metadata load on a shared fs
        self.peer_every = max(1, min(3, round(30.0 / interval_s)))
        self.cost_start = (time.monotonic(), *self_cost())

    def _nvml_source(self) -> tuple[Optional[str], Optional[dict[str, str]]]:
        sim = self.cfg.sections["simulation"]
        if sim["scenario"] or sim["scenario_dir"]:
            from gpuguard.simulate.sources import resolve_sources  # simulated node: the fake NVML and its scenario

            sources = resolve_sources(self.cfg, self.node)
            return sources.nvml_library, sources.nvml_env
        return self.cfg.sections["sources"]["nvml_library"], None

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
        idle = bool(gpus) and all(g.util_pct is not None and g.util_pct <= self.p["idle_util_pct"] for g in gpus)
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
            from gpuguard.notify import flush

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
        alerts = [a for a in raw_host if now - self.first_seen[a.key] >= p["sustain_s"]]
        alerts += [a for a in raw_gpu if a.kind != "straggler" or self.streak[a.key] >= p["straggler_samples"]]
        alerts += [a for a in (progress_hang(now, self.started, self.last_progress, report["last_iteration"],
                                             report["train_log"], p),
                               idle_hang(now, self.idle_since, list(self.peers.values()), p)) if a is not None]
        return one_per_gpu_cause(alerts)

    # ------------------------------------------------------------------ alerts: one message per episode
    def _notify(self, event: Any, budget_s: float = 2.0) -> str:
        from gpuguard.notify import emit

        return emit(self.cfg, event, budget_s=budget_s, state_path=self.notify_state)

    def _gpu_identity(self, index: int) -> dict[str, Any]:
        """UUID, serial and PCI address of a GPU for its alerts (asked once per GPU; NVML may not know all)."""
        if index not in self.gpu_ids:
            ident: dict[str, Any] = {"index": index}
            handle, nv = dict(self.gpus.handles).get(index), self.gpus.nv
            if handle is not None and nv is not None:
                from gpuguard.probes.nvml import normalize_pci_bus_id

                for key, fn in (("uuid", "nvmlDeviceGetUUID"), ("serial", "nvmlDeviceGetSerial"),
                                ("pci_bus_id", "nvmlDeviceGetPciInfo")):
                    try:
                        value = getattr(nv, fn)(handle)
                        value = getattr(value, "busId", value)
                        value = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
                        if value:
                            ident[key] = normalize_pci_bus_id(value) if key == "pci_bus_id" else value
                    except Exception:  # noqa: BLE001 - NOT_SUPPORTED, a lost GPU: the index still names it
                        pass
            self.gpu_ids[index] = ident
        return self.gpu_ids[index]

    def _event(self, a: Alert, now: float, state: str = "firing", message: Optional[str] = None,
               evidence: Optional[dict[str, Any]] = None) -> Any:
        from gpuguard.notify import Event

        ev = dict(a.evidence if evidence is None else evidence)
        if a.gpu is not None:
            ev["gpu"] = a.gpu
        return Event(kind=a.kind, node=self.node, message=message or a.message, severity=a.severity,
                     check_id=a.check_id, action=a.action if state == "firing" else None, job_id=self.job_id,
                     evidence=ev, ts=now, state=state, gpu=a.gpu,
                     gpus=[self._gpu_identity(a.gpu)] if a.gpu is not None else [],
                     # a hang is the job's: one incident per job, whichever node reports or resolves it
                     scope="job" if a.kind == "hang" and self.job_id else "node")

    def _record(self, event: dict[str, Any]) -> None:
        try:
            self.jobdir.record_event(event)
        except OSError:
            pass

    def _claim_hang(self, now: float) -> tuple[bool, bool]:
        """(this node holds the job's hang episode, it has just opened it and pages). The monitor runs on every
        node of the job: N nodes must not page N times."""
        if not self.job_id:
            return True, True
        from gpuguard.monitor.actions import claim_hang, hang_claim_path

        if self.hang_claim is None:
            self.hang_claim = hang_claim_path(self.jobdir.path("claims"), self.job_id, self.restart)

        def alive(owner: str) -> bool:  # its monitor still writes reports
            try:
                return owner in self.jobdir.read_reports(max(3 * self.interval, 60.0), now)
            except OSError:
                return True  # cannot tell: never page twice

        try:
            outcome = claim_hang(self.hang_claim, self.node, now, alive)
        except OSError as e:  # the job directory is unusable: two pages are better than none
            _log(f"cannot claim the job's hang in {self.jobdir.root}: {e}; reporting it from this node")
            return True, True
        return outcome in ("new", "mine", "adopted"), outcome == "new"

    def _release_hang(self) -> bool:
        """True when this node held the job's hang episode (and has now closed it)."""
        if not self.job_id:
            return True
        if self.hang_claim is None:
            return False
        from gpuguard.monitor.actions import release_hang

        try:
            return release_hang(self.hang_claim, self.node)
        except OSError:
            return False

    def _fire(self, now: float, alerts: list[Alert]) -> list[str]:
        """An alert is sent when its condition starts (per node, GPU and check) and not again while it lasts;
        a job's hang is sent once by the node that claims it first (which also requeues)."""
        fired = []
        for a in alerts:
            self.clear_streak.pop(a.key, None)
            if a.key in self.active:
                continue
            self.active[a.key] = a
            evidence = dict(a.evidence)
            pages = True
            if a.kind == "hang":
                evidence["stacks"] = self._dump_stacks(now)  # every node dumps its own: find the stuck rank
                _, pages = self._claim_hang(now)
            _log(f"{a.severity.upper()} {a.check_id}: {a.message}")
            self._record({"ts": now, "node": self.node, "kind": a.kind, "check": a.check_id,
                          "severity": a.severity, "message": a.message, "gpu": a.gpu, "reported": pages})
            if not pages:
                continue  # another node reports this job's hang (and requeues), or this node already did
            fired.append(f"{a.check_id}:{self._notify(self._event(a, now, evidence=evidence))}")
            if a.kind == "hang" and self.p["requeue_on_hang"] and self.job_id:
                self._requeue(now, a)
        return fired

    def _resolve(self, now: float, current: set[str]) -> list[str]:
        """An episode ends when its condition has been clear for `straggler_samples` samples in a row (a hang:
        when progress resumes): a "resolved" message with the alert's dedupe key."""
        out = []
        for key, a in list(self.active.items()):
            if key in current:
                continue
            self.clear_streak[key] = self.clear_streak.get(key, 0) + 1
            if a.kind != "hang" and self.clear_streak[key] < max(1, self.p["straggler_samples"]):
                continue
            del self.active[key]
            self.clear_streak.pop(key, None)
            if a.kind == "hang":
                if any(x.kind == "hang" for x in self.active.values()) or not self._release_hang():
                    continue  # still hung here, or another node holds the job's hang
                message = f"the job makes progress again ({a.check_id} cleared; it was: {a.message})"
            else:
                message = f"cleared: {a.message}"
            out.append(self._send_resolved(a, now, message))
        return out

    def _send_resolved(self, a: Alert, now: float, message: str, budget_s: float = 2.0) -> str:
        _log(f"RESOLVED {a.check_id}: {message}")
        self._record({"ts": now, "node": self.node, "kind": a.kind, "check": a.check_id, "state": "resolved",
                      "message": message, "gpu": a.gpu})
        return f"{a.check_id}:{self._notify(self._event(a, now, state='resolved', message=message), budget_s)}"

    def resolve_all(self, why: str, budget_s: float = 10.0) -> list[str]:
        """The job ended (the monitor was stopped by srun/scancel): every open episode is resolved, so receivers
        do not keep incidents open for a job that is gone; one last try at the spool."""
        from gpuguard.notify import flush

        now, end = time.time(), time.monotonic() + budget_s
        out, hang_done = [], False
        for key, a in list(self.active.items()):
            left = end - time.monotonic()
            if left <= 0.2:
                break
            del self.active[key]
            if a.kind == "hang":
                if hang_done or not self._release_hang():
                    continue
                hang_done = True
            out.append(self._send_resolved(a, now, f"{why} (it was: {a.message})", min(2.0, left)))
        left = end - time.monotonic()
        if left > 0.2:
            flush(self.cfg, budget_s=min(2.0, left), state_path=self.notify_state)
        return out

    def _dump_stacks(self, now: float) -> str:
        from gpuguard.monitor.actions import dump_stacks, find_py_spy, job_python_pids

        try:
            pids = job_python_pids(self.job_id, self.gpus.gpu_pids() if not self.gpus.init_error else [])
            summary = dump_stacks(find_py_spy(self.p["py_spy"]), pids, self.jobdir.stacks_path(self.node, now),
                                  self.p["command_timeout_s"])
        except Exception as e:  # noqa: BLE001
            summary = f"stack dump failed: {type(e).__name__}: {e}"
        _log(summary)
        return summary

    def _requeue(self, now: float, alert: Alert) -> None:
        from gpuguard.monitor.actions import requeue
        from gpuguard.notify import Event

        if not self.jobdir.claim(f"requeue-{self.job_id}-{int(self.started)}", self.node):
            return
        ok, detail = requeue(self.p["requeue_command"], str(self.job_id), self.p["command_timeout_s"])
        _log(f"requeue after {alert.check_id}: {detail}")
        try:
            self.jobdir.record_event({"ts": now, "node": self.node, "kind": "requeue", "check": alert.check_id,
                                      "ok": ok, "detail": detail})
        except OSError:
            pass
        self._notify(Event(kind="requeue", node=self.node, job_id=self.job_id, check_id=alert.check_id,
                           severity="warning" if ok else "critical",
                           message=f"job {self.job_id} {'requeue requested' if ok else 'requeue FAILED'} after: "
                                   f"{alert.message}", evidence={"command": detail}, ts=now,
                           action=None if ok else "requeue or cancel the job by hand"))

    def _write_metrics(self, report: dict[str, Any], alerts: list[Alert]) -> None:
        from gpuguard.metrics.textfile import textfile_dir

        directory = textfile_dir(self.cfg, self.node)
        if not directory:
            return
        try:
            from gpuguard.monitor.metrics import monitor_families
            from gpuguard.metrics.textfile import write_families

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
        from gpuguard.metrics.textfile import MONITOR_FILE, remove, textfile_dir

        directory = textfile_dir(self.cfg, self.node)
        if directory:
            remove(directory, MONITOR_FILE)


def main_from_args(args: Any) -> int:
    import json

    from gpuguard.config.schema import load_config
    from gpuguard.context import parse_gpu_list

    cfg = load_config(args.config)
    p = cfg.sections["monitor"]
    node = args.node or cfg.sections["node"]["name"] or os.environ.get("SLURMD_NODENAME") or \
        socket.gethostname().split(".")[0]
    job_id = args.job_id or os.environ.get("SLURM_JOB_ID")
    interval = args.interval or p["interval_s"]
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
