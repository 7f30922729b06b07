"""The watch daemon's main thread: follow the kernel log, judge each line, hand events to the drain worker.

    follower (kernellog source) --lines--> judge (gpu.xid + policy) --events--> DrainWorker thread --> Slurm, store
         ^                                                                         |
         +------------------- cursor: only past what is judged and acted on <------+

It only reads and judges; everything that can be slow happens in the worker (gpuguard.watch.worker).
SIGTERM/SIGINT stop cleanly (exit 0), SIGHUP reloads the config, and so does an edit of the config file
(gpuguard.watch.configfile).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from gpuguard.agent.supervise import AgentProcess
from gpuguard.config.schema import Config, ConfigError
from gpuguard.siteconfig import load_config
from gpuguard.config.schema import config_path as resolve_config_path
from gpuguard.kernellog.base import FollowError, KernelLogSource, StoredCursor, read_boot_id
from gpuguard.kernellog.cursor import describe as describe_cursor
from gpuguard.kernellog.sources import make_follower
from gpuguard.metrics.heartbeat import WatchHeartbeat
from gpuguard.pipeline.journal import Journal, runtime_dir
from gpuguard.pipeline.positions import watch_start
from gpuguard.simulate.sources import resolve_sources
from gpuguard.store.sqlite import Store
from gpuguard.util.log import HookLog
from gpuguard.watch.configfile import ConfigFileWatch
from gpuguard.watch.judge import WatchJudge, xid_line_spans
from gpuguard.watch.settings import WatchSettings, cursor_name, make_log, store_path
from gpuguard.watch.systemd import sd_notify, watchdog_interval
from gpuguard.watch.worker import DrainWorker
from gpuguard.xid.catalog import load_catalog

Cursor = StoredCursor
Follower = KernelLogSource

CURSOR_FLUSH_S = 1.0  # how often a moving cursor is written to the store (it only saves re-reading)
PUMP_BUDGET_S = 0.5  # longest stretch of reading before signals and timers get a look in


@dataclass
class WatchStats:
    batches: int = 0
    bytes_judged: int = 0
    events_submitted: int = 0
    forged_reported: int = 0
    started_mono: float = field(default_factory=time.monotonic)


class WatchDaemon:
    """Follow, judge, hand events to the worker. `run()` returns the exit code."""

    def __init__(self, cfg: Config, *, node: str, config_path: Optional[str] = None, source: Optional[str] = None,
                 once: bool = False, log: Optional[HookLog] = None, slurm_client: Any = None,
                 agent: bool = False) -> None:
        self.cfg = cfg
        self.node = node
        self.config_path = config_path
        self.source_override = source
        self.once = once
        self.log = log or make_log(cfg)
        self.slurm_client = slurm_client
        self.settings = WatchSettings.from_config(cfg)
        self.stats = WatchStats()
        self.follower: Optional[Follower] = None
        self.worker: Optional[DrainWorker] = None
        self.judge: Optional[WatchJudge] = None
        self.spec = ""
        self.boot_id: Optional[str] = None
        self.ready = threading.Event()
        self._stop = False
        self._reload = False
        self.config_file = None if once else ConfigFileWatch(resolve_config_path(config_path)[0], time.monotonic())
        self._cursor: Optional[Cursor] = None
        self._cursor_dirty = False
        self._cursor_sent = 0.0
        self._forged_seen = 0
        self._forged_reported_at = -1e18
        self.heartbeat = WatchHeartbeat(node, enabled=not once)  # liveness metric for the "watch down" alert
        self.agent = AgentProcess(self.log) if agent and not once else None  # the hooks' node agent (gpuguard.agent)
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)

    # ---------------------------------------------------------------- control (any thread, or a signal handler)
    def request_stop(self) -> None:
        self._stop = True
        self._wake()

    def request_reload(self) -> None:
        self._reload = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake (pipe full) or closing

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        signal.signal(signal.SIGINT, lambda *_: self.request_stop())
        signal.signal(signal.SIGHUP, lambda *_: self.request_reload())

    # ---------------------------------------------------------------- setup
    def _resolve_spec(self, cfg: Config) -> tuple[str, Optional[str]]:
        """(source spec, boot id): --source, else the simulated node's kmsg file, else watch.source, else
        sources.kernel_log. simulate.sources.resolve_sources is what makes a simulated node look like a real one."""
        if self.source_override:  # an explicit log: this host's boot, whatever the simulation config says
            return self.source_override, read_boot_id(cfg.sources.boot_id_path)
        sources = resolve_sources(cfg, self.node)
        if sources.simulated:
            spec = sources.kernel_log
        else:
            spec = self.settings.source or sources.kernel_log
        return spec, sources.boot_id or read_boot_id(sources.boot_id_path)

    def _stored_cursor(self) -> Optional[Cursor]:
        """The node's one kernel-log position (gpuguard.pipeline.positions): a first start begins where the hooks
        got to, so the Xids they judged (and an admin may have cleared since) are not judged again."""
        return watch_start(self.cfg, self.node, self._own_cursor())

    def _own_cursor(self) -> Optional[Cursor]:
        try:
            part = Journal.load(runtime_dir(self.cfg), self.node, part="watch")
            if part.positions.get("watch"):
                return part.positions["watch"]  # survives a damaged store
        except Exception:  # noqa: BLE001 - the store's copy
            pass
        try:
            with Store(store_path(self.cfg, self.node), timeout_s=5.0) as st:
                return st.get_cursor(cursor_name(self.node))
        except Exception as e:  # noqa: BLE001 - no history: start as configured, loudly
            self.log.error(f"watch {self.node}: cannot read the cursor from the store ({type(e).__name__}: {e}); "
                           f"starting at watch.start_at={self.settings.start_at}")
            return None

    def _open_follower(self, cursor: Optional[Cursor]) -> Follower:
        return make_follower(self.spec, cursor=cursor, boot_id=self.boot_id, start_at=self.settings.start_at,
                             poll_interval_s=self.settings.poll_interval_s, follow=not self.once)

    def _catalog(self, cfg: Config) -> Any:
        return load_catalog(overrides=cfg.xid.overrides or None)

    def setup(self) -> None:
        """Raises FollowError / ValueError / OSError when there is nothing to follow."""
        self.spec, self.boot_id = self._resolve_spec(self.cfg)
        self.judge = WatchJudge(self._catalog(self.cfg), self.settings.dedupe_window_s)
        cursor = self._stored_cursor()
        self.follower = self._open_follower(cursor)
        self._cursor = cursor
        self.worker = DrainWorker(self.cfg, self.node, self.boot_id, self.log, self.slurm_client)
        self.worker.start()
        if self.agent is not None:
            self.agent.start()
        resumed = f"resuming after {describe_cursor(cursor)}" if cursor else f"start_at={self.settings.start_at}"
        self.log.info(f"watch {self.node}: following {self.follower.spec} ({resumed}, boot {self.boot_id})")

    # ---------------------------------------------------------------- main loop
    def run(self) -> int:
        try:
            self.setup()
        except (FollowError, ValueError, OSError) as e:
            self.log.error(f"watch {self.node}: cannot follow the kernel log: {e}")
            return 2
        assert self.follower is not None and self.worker is not None
        sd_notify(f"READY=1\nSTATUS=following {self.follower.spec} for {self.node}")
        self.ready.set()
        wd = watchdog_interval()
        wd_next = time.monotonic()
        try:
            while not self._stop:
                if self._reload:
                    self._do_reload()
                progressed = self._pump()
                self._log_notes()
                now = time.monotonic()
                self._flush_cursor(now)
                self._report_forged(now)
                self.heartbeat.beat(self.cfg, now, self.log, self._pending_drains())
                if self.config_file is not None and self.config_file.settled_change(now):
                    self.log.info(f"watch {self.node}: {self.config_file.path} changed")
                    self._do_reload()
                if wd is not None and now >= wd_next:
                    sd_notify("WATCHDOG=1")
                    wd_next = now + wd
                if self.once and not progressed and self._source_exhausted():
                    break
                if progressed:
                    continue
                self._wait(self._timeout(now, wd_next if wd is not None else None))
        finally:
            sd_notify("STOPPING=1")
            code = self._shutdown()
        return code

    def _source_exhausted(self) -> bool:
        return bool(getattr(self.follower, "finished", True))

    def _pending_drains(self) -> int:
        if self.worker is None:
            return 0
        w = self.worker
        return max(len(w.pending), w.journal_pending + sum(1 for p in w.pending if not p.journaled))

    def _timeout(self, now: float, wd_next: Optional[float]) -> Optional[float]:
        assert self.follower is not None
        due: list[float] = []
        if self.follower.wait_fd() is None:
            due.append(self.follower.poll_interval_s)
        if self._cursor_dirty:
            due.append(max(0.0, self._cursor_sent + CURSOR_FLUSH_S - now))
        if self._forged_seen > self.stats.forged_reported:
            due.append(max(0.0, self._forged_reported_at + self.settings.dedupe_window_s - now))
        if wd_next is not None:
            due.append(max(0.0, wd_next - now))
        beat = self.heartbeat.due_in(self.cfg, now)
        if beat is not None:
            due.append(beat)
        if self.once:
            due.append(0.05)
        if self.config_file is not None:
            due.append(max(0.0, self.config_file.next_check - now))
        return min(due) if due else None  # None: sleep until the kernel log or a signal wakes us

    def _wait(self, timeout: Optional[float], follower: bool = True) -> None:
        """Sleep until the source has news, a signal or request_stop/reload arrives, or `timeout` passes."""
        assert self.follower is not None
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fd = self.follower.wait_fd() if follower else None
        if fd is not None:
            poller.register(fd, select.POLLIN | select.POLLPRI)
        try:
            poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999)))
        except InterruptedError:
            pass
        try:
            while os.read(self._wake_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass

    def _pump(self) -> bool:
        """Read and judge whatever is there (bounded in time, so signals and timers keep their turn)."""
        assert self.follower is not None
        progressed = False
        until = time.monotonic() + PUMP_BUDGET_S
        while not self._stop:
            try:
                batch = self.follower.poll()
            except OSError as e:
                self.log.error(f"watch {self.node}: reading {self.follower.spec}: {e}")
                self._wait(1.0, follower=False)  # do not spin on a source that keeps failing
                break
            if batch is None:
                break
            progressed = True
            self._judge_batch(batch)
            if time.monotonic() > until:
                break
        return progressed

    def _judge_batch(self, batch: Any) -> None:
        assert self.judge is not None and self.worker is not None
        now = time.monotonic()
        wall = time.time()
        data: bytes = batch.data
        fatal = False
        for start, end in xid_line_spans(data, batch.json_lines):
            we = self.judge.judge_bytes(data[start:end], now, batch.skip_seq_upto)
            if we is None:
                continue
            self.stats.events_submitted += 1
            self.worker.submit_event(we, batch.cursor_at(start) if we.fatal else None, wall, now)
            if we.fatal:
                fatal = True
                self.log.error(f"watch {self.node}: fatal Xid {we.event.code} ({we.info.name}) on {we.event.pci}: "
                               f"draining [{we.action.value}]")
            else:
                self.log.info(f"watch {self.node}: Xid {we.event.code} ({we.info.name}) on {we.event.pci}: "
                              f"{we.info.severity}-class, recorded"
                              + (f" ({we.repeats_before} repeats folded since the last report)"
                                 if we.repeats_before else ""))
        self.stats.batches += 1
        self.stats.bytes_judged += len(data)
        self._forged_seen = self.judge.counts.forged
        self._cursor = batch.cursor_at(len(data))
        self._cursor_dirty = True
        if fatal:
            self._flush_cursor(now, force=True)

    def _flush_cursor(self, now: float, force: bool = False) -> None:
        if self._cursor_dirty and self._cursor is not None and (force or now - self._cursor_sent >= CURSOR_FLUSH_S):
            assert self.worker is not None
            self.worker.submit_cursor(self._cursor)
            self._cursor_dirty = False
            self._cursor_sent = now

    def _report_forged(self, now: float) -> None:
        """Forged Xid lines are never events, but someone is writing them: say so, at most once a window."""
        new = self._forged_seen - self.stats.forged_reported
        if new <= 0 or now - self._forged_reported_at < self.settings.dedupe_window_s:
            return
        assert self.worker is not None
        self.log.warning(f"watch {self.node}: {new} Xid-looking line(s) not from the kernel ignored (logger?); "
                         "investigate, the node is not drained for them")
        assert self.judge is not None
        self.worker.submit_forged(self.judge.forged_findings(new))
        self.stats.forged_reported = self._forged_seen
        self._forged_reported_at = now

    def _log_notes(self) -> None:
        assert self.follower is not None
        for note in self.follower.notes:
            self.log.warning(f"watch {self.node}: {note}")
        self.follower.notes.clear()

    # ---------------------------------------------------------------- reload and shutdown
    def _do_reload(self) -> None:
        self._reload = False
        if self.config_file is not None:
            self.config_file.loading()
        try:
            cfg = load_config(self.config_path)
        except ConfigError as e:
            self.log.error(f"watch {self.node}: reload failed, keeping the running config: {e}")
            return
        old_spec = self.spec
        self.cfg = cfg
        self.settings = WatchSettings.from_config(cfg)
        self.log = make_log(cfg)
        assert self.judge is not None and self.worker is not None and self.follower is not None
        try:
            self.judge.catalog = self._catalog(cfg)
            self.judge.dedupe.window_s = self.settings.dedupe_window_s
            spec, boot_id = self._resolve_spec(cfg)
        except Exception as e:  # noqa: BLE001 - a bad new config must not kill a running watch
            self.log.error(f"watch {self.node}: reload failed, keeping the running source: {type(e).__name__}: {e}")
            spec, boot_id = old_spec, self.boot_id
        self.worker.log = self.log
        self.worker.reconfigure(cfg)
        if spec != old_spec:
            try:
                self.spec, self.boot_id = spec, boot_id
                new = self._open_follower(self._cursor)
            except (FollowError, OSError) as e:
                self.spec = old_spec
                self.log.error(f"watch {self.node}: cannot follow {spec} ({e}); still following {old_spec}")
            else:
                self.follower.close()
                self.follower = new
        self.log.info(f"watch {self.node}: configuration reloaded from {cfg.source}; following {self.follower.spec}")

    def _shutdown(self) -> int:
        worker, follower = self.worker, self.follower
        unresolved = 0
        if self.agent is not None:
            self.agent.stop()
        if worker is not None:
            if self._cursor is not None:
                worker.submit_cursor(self._cursor)
            if self.once:
                self._settle_once(worker)
            unresolved = max(len(worker.pending), worker.journal_pending)
            worker.stop()
            worker.join(timeout=2 * self.settings.scontrol_s + 5)
        # a clean stop says so at once (gpuguard_watch_up 0); a crash leaves the heartbeat to go stale
        self.heartbeat.beat(self.cfg, time.monotonic(), self.log, unresolved, up=False, force=True)
        if follower is not None:
            follower.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if unresolved:
            self.log.error(f"watch {self.node}: exiting with {unresolved} drain(s) not done; they stay pending in the "
                           "verdict journal (or the cursor stays before them), so the next start applies them")
        else:
            self.log.info(f"watch {self.node}: stopped")
        return 1 if self.once and unresolved else 0

    def _settle_once(self, worker: DrainWorker) -> None:
        """--once: let every queued event get its first drain attempt (no back-off retries)."""
        limit = time.monotonic() + 2 * self.settings.scontrol_s + 5
        worker.peeked.wait(max(0.0, limit - time.monotonic()))
        while time.monotonic() < limit:
            pending = list(worker.pending)
            if worker.quiet() and (not pending or pending[0].attempts > 0):
                return
            time.sleep(0.01)
