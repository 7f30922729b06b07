"""`gpuguard watch`: a daemon that follows the kernel log and drains the node within a second of a fatal Xid.

    follower (kernellog source) --lines--> judge (gpu.xid + policy) --events--> DrainWorker thread --> Slurm, store
         ^                                                                         |
         +------------------- cursor: only past what is judged and acted on <------+

- The main thread only reads and judges. Everything that can be slow (scontrol, SQLite, notifications) happens
  in one worker thread fed by a queue, so a hung slurmctld never stops the log from being followed.
- A fatal Xid drains through `gpuguard.slurm.client.drain_node` (ownership rules: a node drained, down or in
  maintenance by someone else is never touched) with the prolog's reason shape and `[watch <action>]`.
  A failed attempt is retried with exponential back-off until it resolves (done / already / foreign).
- The cursor (`watch:<node>` in the store) only moves past a fatal Xid once its drain resolved: a restart
  re-judges an Xid whose drain never happened, and never re-drains for one that was acted on.
- SIGTERM/SIGINT stop cleanly (exit 0), SIGHUP reloads the config. With $NOTIFY_SOCKET (systemd Type=notify)
  it reports READY/STOPPING and pings the watchdog.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from gpuguard.agent.supervise import AgentProcess
from gpuguard.config.schema import Config, ConfigError, load_config
from gpuguard.kernellog.base import FollowError, KernelLogSource, StoredCursor, read_boot_id
from gpuguard.kernellog.cursor import describe as describe_cursor
from gpuguard.kernellog.sources import make_follower
from gpuguard.util.log import HookLog
from gpuguard.metrics.node import WatchHeartbeat
from gpuguard.model import Finding
from gpuguard.pipeline.act import new_pending
from gpuguard.pipeline.journal import Journal, runtime_dir
from gpuguard.pipeline.lock import NodeLock, lock_path
from gpuguard.watch.judge import CHECK_ID, WatchEvent, WatchJudge, node_verdict, xid_line_spans

Cursor = StoredCursor
Follower = KernelLogSource

CURSOR_FLUSH_S = 1.0  # how often a moving cursor is written to the store (it only saves re-reading)
NOTIFY_FLUSH_S = 60.0  # how often undelivered notifications are retried (only when notify.urls is set)
PUMP_BUDGET_S = 0.5  # longest stretch of reading before signals and timers get a look in


@dataclass
class WatchSettings:
    source: Optional[str]
    start_at: str
    dedupe_window_s: float
    poll_interval_s: float
    retry_initial_s: float
    retry_max_s: float
    record_non_fatal: bool
    scontrol_s: float
    on_failure: str

    @classmethod
    def from_config(cls, cfg: Config) -> "WatchSettings":
        w = cfg.sections.get("watch") or {}
        return cls(source=w.get("source"), start_at=w.get("start_at", "auto"),
                   dedupe_window_s=float(w.get("dedupe_window_s", 300.0)),
                   poll_interval_s=float(w.get("poll_interval_s", 0.25)),
                   retry_initial_s=float(w.get("retry_initial_s", 1.0)),
                   retry_max_s=float(w.get("retry_max_s", 60.0)),
                   record_non_fatal=bool(w.get("record_non_fatal", True)),
                   scontrol_s=float(cfg.sections["deadlines"]["scontrol_s"]),
                   on_failure=cfg.sections["policy"]["on_failure"])


def cursor_name(node: str) -> str:
    # separate from the prolog's `kernel_log:<node>`: each consumer judges every record once
    return f"watch:{node}"


def store_path(cfg: Config, node: str) -> str:
    return str(cfg.sections["store"]["path"]).replace("{node}", node)


def make_log(cfg: Config) -> HookLog:
    lg = cfg.sections["logging"]
    # under systemd stderr already lands in the journal: with syslog on too, every line would be there twice
    return HookLog(lg["syslog"], lg["file"], lg["level"], stderr=not lg["syslog"] or sys.stderr.isatty())


# --------------------------------------------------------------------------- systemd notification


def sd_notify(message: str) -> bool:
    """Tell systemd (Type=notify) something, e.g. READY=1. No $NOTIFY_SOCKET: not under systemd, nothing to do."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    elif not addr.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.settimeout(1.0)
            s.connect(addr)
            s.sendall(message.encode("utf-8", errors="replace"))
    except OSError:
        return False
    return True


def watchdog_interval() -> Optional[float]:
    """Half of systemd's WatchdogSec when it is set for this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


# --------------------------------------------------------------------------- the worker: Slurm and the store


@dataclass
class _Pending:
    we: WatchEvent
    reason: str
    finding: Finding
    before_cursor: Optional[Cursor]
    seen_wall: float
    seen_mono: float
    attempts: int = 0
    run_id: Optional[int] = None
    failure_recorded: bool = False
    pending_id: Optional[str] = None  # its entry in the node's verdict journal (gpuguard.pipeline.journal)
    journaled: bool = False  # durable there: the kernel-log position may move past it, and the prolog refuses jobs


@dataclass
class DrainOutcomeRecord:
    """What happened to one fatal event (kept in memory for `--once`, tests and the benchmark)."""

    reason: str
    outcome: str
    detail: str
    attempts: int
    latency_s: float  # from reading the Xid to Slurm answering the drain


class DrainWorker(threading.Thread):
    """Owns the Slurm client and the store. Messages are handled in order, so a cursor sent after an event is
    never stored before that event is dealt with."""

    def __init__(self, cfg: Config, node: str, boot_id: Optional[str], log: HookLog,
                 slurm_client: Any = None) -> None:
        super().__init__(name="gpuguard-watch-drain", daemon=True)
        self.node = node
        self.boot_id = boot_id
        self.log = log
        self._injected_client = slurm_client
        self._configure(cfg)
        self.q: "queue.Queue[tuple[Any, ...]]" = queue.Queue()
        self.pending: list[_Pending] = []
        self.outcomes: list[DrainOutcomeRecord] = []
        self.recorded_runs = 0
        self._latest_cursor: Optional[Cursor] = None
        self._persisted: Optional[Cursor] = None
        self._next_attempt = 0.0
        self._backoff = self.settings.retry_initial_s
        self._store: Any = None
        self._store_error_logged = 0.0
        self._flusher: Optional[threading.Thread] = None
        self._next_flush = time.monotonic() + NOTIFY_FLUSH_S
        self._next_ship = time.monotonic() + 5.0  # central history (store.url): gpuguard.fleet.ship
        self._next_peek = time.monotonic()  # drains the hooks could not apply: the watch retries them too
        self.journal_pending = 0  # pending drains in the node's verdict journal (any writer), last seen
        self.peeked = threading.Event()  # the journal was looked at once since the start (--once waits for it)

    def _configure(self, cfg: Config) -> None:
        self.cfg = cfg
        self.settings = WatchSettings.from_config(cfg)
        self._client = self._injected_client

    # ---------------------------------------------------------------- API for the main thread
    def submit_event(self, we: WatchEvent, before_cursor: Optional[Cursor], seen_wall: float,
                     seen_mono: float) -> None:
        self.q.put(("event", we, before_cursor, seen_wall, seen_mono))

    def submit_cursor(self, cursor: Cursor) -> None:
        self.q.put(("cursor", cursor))

    def submit_forged(self, findings: list[Finding]) -> None:
        self.q.put(("forged", findings))

    def reconfigure(self, cfg: Config) -> None:
        self.q.put(("config", cfg))

    def stop(self) -> None:
        self.q.put(("stop",))

    def quiet(self) -> bool:
        """Every message handled (pending retries may remain)."""
        return self.q.unfinished_tasks == 0

    # ---------------------------------------------------------------- the thread
    def run(self) -> None:
        try:  # open (and, on a new node, create) the store now, not on the first Xid's way to a drain
            self._open_store()
        except Exception as e:  # noqa: BLE001
            self._store_failed("opening the history store", e)
        try:  # drains decided earlier (by a hook, or before this daemon restarted) are retried first
            self._peek_journal()
        except Exception as e:  # noqa: BLE001
            self.log.error(f"watch {self.node}: reading the verdict journal: {type(e).__name__}: {e}")
        finally:
            self.peeked.set()
        while True:
            due = [self._next_attempt] if self.pending else [self._next_peek]
            if _notify_enabled(self.cfg):
                due.append(self._next_flush)
            if self.cfg.sections["store"].get("url"):
                due.append(self._next_ship)
            timeout = max(0.0, min(due) - time.monotonic()) if due else None  # None: idle until a message
            try:
                msg = self.q.get(timeout=timeout)
            except queue.Empty:
                msg = None
            try:
                if msg is not None and msg[0] == "stop":
                    self._persist_cursor()
                    self._close_store()
                    return
                if msg is not None:
                    self._handle(msg)
                    if msg[0] == "event":  # a drain reaches the central history within seconds
                        self._next_ship = min(self._next_ship, time.monotonic() + 2.0)
                if self.cfg.sections["store"].get("url") and time.monotonic() >= self._next_ship:
                    from gpuguard.fleet.ship import ship_in_background  # its own thread, store and connection

                    self._next_ship = time.monotonic() + self.cfg.sections["store"]["ship_interval_s"]
                    ship_in_background(self.cfg, self.node)
                if self.pending and time.monotonic() >= self._next_attempt:
                    self._attempt()
                elif not self.pending and time.monotonic() >= self._next_peek:
                    self._peek_journal()
                if _notify_enabled(self.cfg) and time.monotonic() >= self._next_flush:
                    self._next_flush = time.monotonic() + NOTIFY_FLUSH_S
                    if self._flusher is None or not self._flusher.is_alive():
                        self._flusher = threading.Thread(target=_notify_flush, args=(self.cfg, self.log),
                                                         name="gpuguard-watch-notify-flush", daemon=True)
                        self._flusher.start()
            except Exception as e:  # noqa: BLE001 - the worker must outlive any single bad message
                self.log.error(f"watch {self.node}: internal error in the drain worker: {type(e).__name__}: {e}")
            finally:
                if msg is not None:
                    self.q.task_done()

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "cursor":
            self._latest_cursor = msg[1]
            self._persist_cursor()
        elif kind == "event":
            self._on_event(msg[1], msg[2], msg[3], msg[4])
        elif kind == "forged":
            self._record_run(time.time(), "warn", None, None, msg[1], None)
        elif kind == "config":
            self._configure(msg[1])

    def _on_event(self, we: WatchEvent, before: Optional[Cursor], seen_wall: float, seen_mono: float) -> None:
        findings = list(we.findings)
        if not we.fatal:
            if self.settings.record_non_fatal:
                self._record_run(seen_wall, node_verdict(findings).outcome, None, None, findings, None)
            return
        verdict = node_verdict([self._escalated(f) for f in findings], self.settings.on_failure)
        finding = verdict.primary
        assert finding is not None and verdict.reason is not None
        p = _Pending(we, verdict.reason, finding, before, seen_wall, seen_mono)
        if verdict.reported_only:
            # a first rollout: record what would have been drained, touch nothing
            run_id = self._record_run(seen_wall, "warn", p.reason, finding, [finding], None)
            self._record_drain(p, "skipped", "policy.on_failure is report: not drained", run_id)
            self.outcomes.append(DrainOutcomeRecord(p.reason, "skipped", "report only", 0, 0.0))
            self.log.warning(f"watch {self.node}: fatal {finding.message} (Xid {we.event.code}); "
                             f"policy.on_failure=report, not draining: {p.reason}")
            return
        self._journal_pending(p, verdict, seen_wall)
        self.pending.append(p)
        if len(self.pending) == 1:
            self._next_attempt = 0.0  # Slurm is not known to be failing: try at once

    # ---------------------------------------------------------------- the node's verdict journal (shared with hooks)
    @contextlib.contextmanager
    def _shared_journal(self) -> Iterator[Optional[Journal]]:
        """The node's verdict journal, under the node lock (the hooks read-modify-write it too); None when the lock
        cannot be had right now (a hook holds it: try again later)."""
        rd = runtime_dir(self.cfg)
        with NodeLock(lock_path(rd, self.node), 2.0,
                      fallback=f"{store_path(self.cfg, self.node)}.{self.node}.lock") as locked:
            yield Journal.load(rd, self.node) if locked else None

    def _journal_pending(self, p: _Pending, verdict: Any, seen_wall: float) -> None:
        """The drain stands until applied: recorded as pending before Slurm is asked, so a restart, a prolog (which
        refuses jobs meanwhile) or the next health check carries it on even if this daemon dies."""
        try:
            with self._shared_journal() as j:
                if j is None:
                    return
                entry = j.add_pending(new_pending(verdict, "watch", seen_wall))
                if j.save() is None:
                    p.pending_id, p.journaled = entry.id, True
        except Exception as e:  # noqa: BLE001 - the in-memory pending and the held cursor still stand
            self.log.error(f"watch {self.node}: cannot write the verdict journal: {type(e).__name__}: {e}")

    def _peek_journal(self) -> None:
        """Drains a hook decided but could not apply (slurmctld was down) are retried here as well."""
        self._next_peek = time.monotonic() + max(self.settings.retry_initial_s, 5.0)
        try:
            j = Journal.load(runtime_dir(self.cfg), self.node)
        except Exception:  # noqa: BLE001
            return
        self.journal_pending = len(j.pending)
        if j.pending:
            self._attempt_journal()

    def _escalated(self, finding: Finding) -> Finding:
        """As the prolog and health check do: a reboot/reset-class Xid that already drained this node in
        `reboot.escalate_after` earlier boots is not fixed by rebooting: action replace."""
        from gpuguard.model import Action

        rcfg = self.cfg.sections.get("reboot") or {}
        after = int(rcfg.get("escalate_after", 0) or 0)
        if not after or finding.action not in (Action.REBOOT, Action.RESET):
            return finding
        try:
            since = time.time() - float(rcfg.get("window_days", 30.0)) * 86400
            seen = self._open_store().previous_fault_boots(self.node, CHECK_ID, finding.keyword, self.boot_id, since)
        except Exception as e:  # noqa: BLE001 - no history: drain with the catalog's action
            self._store_failed("reading earlier drains", e)
            return finding
        from gpuguard.pipeline.policy import escalate_recurring

        return escalate_recurring([finding], {(CHECK_ID, finding.keyword): seen}, after)[0]

    def _client_or_error(self) -> Any:
        if self._client is None:
            from gpuguard.slurm.client import client_from_config

            self._client = client_from_config(self.cfg.sections["slurm"], self.settings.scontrol_s)
        return self._client

    def _attempt(self) -> None:
        if any(p.journaled for p in self.pending) or not self.pending:
            self._attempt_journal()
        if any(not p.journaled for p in self.pending) and not self._failing():
            self._attempt_direct()

    def _failing(self) -> bool:
        return time.monotonic() < self._next_attempt

    def _attempt_journal(self) -> None:
        """Apply every pending drain of the node's journal (this daemon's and the hooks'), oldest first
        (gpuguard.pipeline.act: applied exactly once, never over someone else's node)."""
        from gpuguard.pipeline.act import SlurmHandle, retry_pending

        with self._shared_journal() as j:
            if j is None:
                self._next_attempt = time.monotonic() + 1.0
                return
            handle = SlurmHandle(self.cfg, None, self._client_or_error())
            applied = retry_pending(j, handle, self.node, bool((self.cfg.sections.get("reboot") or {}).get("auto")))
            j.save()
            self.journal_pending = len(j.pending)
            still = {p.id for p in j.pending}
        for a in applied:
            self._applied(a)
        if any(p.journaled and p.pending_id in still for p in self.pending) or still:
            first = next((p for p in j.pending), None)
            wait = self._backoff
            self._next_attempt = time.monotonic() + wait
            self._next_peek = self._next_attempt
            self._backoff = min(self._backoff * 2, self.settings.retry_max_s)
            attempts = first.attempts if first else 0
            if attempts & (attempts - 1) == 0:  # attempts 1, 2, 4, 8, ...: loud but not a flood
                self.log.error(f"watch {self.node}: pending drain not applied (attempt {attempts}, retrying in "
                               f"{wait:g}s): {first.last_error if first else ''}")
            tries = {q.id: q.attempts for q in j.pending}
            for p in self.pending:
                if p.journaled and p.pending_id in still:
                    p.attempts = tries.get(p.pending_id, p.attempts)
                if p.journaled and p.pending_id in still and not p.failure_recorded:
                    p.run_id = p.run_id or self._record_run(p.seen_wall, "drain", p.reason, p.finding, [p.finding],
                                                            None)
                    self._record_drain(p, "failed", first.last_error or "" if first else "", p.run_id)
                    p.failure_recorded = True
        else:
            self._backoff = self.settings.retry_initial_s
        self._persist_cursor()

    def _applied(self, a: dict[str, Any]) -> None:
        """One journal entry Slurm took (or that someone else's node state made moot)."""
        pd = a["pending"]
        own = next((p for p in self.pending if p.pending_id == pd.id), None)
        if pd.op != "drain":
            self.log.warning(f"watch {self.node}: pending {pd.op} {a['outcome']}: {pd.reason}")
            return
        if own is None:  # a hook's drain, applied by the watch
            self._record_drain_row(pd.reason, pd.check_id, pd.action, a["outcome"],
                                   f"pending since {_iso(pd.created)} (decided by the {pd.origin}); {a['detail']}",
                                   pd.run_id)
            self.log.error(f"watch {self.node}: pending drain from the {pd.origin} applied ({a['outcome']}): "
                           f"{pd.reason}")
            if a["outcome"] == "done":
                _notify_pending_drain(self.cfg, self.node, pd, self.log)
            return
        self.pending.remove(own)
        own.attempts = pd.attempts + 1
        latency = time.monotonic() - own.seen_mono
        if own.run_id is None:
            own.run_id = self._record_run(own.seen_wall, "drain", own.reason, own.finding, [own.finding], latency)
        self._finish(own, a["outcome"], a["detail"], latency)

    def _finish(self, p: _Pending, outcome: str, detail: str, latency: float) -> None:
        self._record_drain(p, outcome, detail, p.run_id)
        self.outcomes.append(DrainOutcomeRecord(p.reason, outcome, detail, p.attempts, latency))
        level = "error" if outcome == "done" else "warning"
        self.log.log(level, f"watch {self.node}: Xid {p.we.event.code} on {p.we.event.pci}: drain {outcome} "
                     f"{latency:.3f}s after the log line was read: {p.reason}" + (f" ({detail})" if detail else ""))
        if outcome == "done":
            _notify_drain(self.cfg, self.node, p, self.log)

    def _attempt_direct(self) -> None:
        """Without a usable verdict journal: the drain is held in memory and the cursor before it."""
        from gpuguard.slurm.client import DrainOutcome, SlurmError, drain_node

        while any(not q.journaled for q in self.pending):
            p = next(q for q in self.pending if not q.journaled)
            try:
                out = drain_node(self._client_or_error(), self.node, p.reason)
            except SlurmError as e:  # e.g. slurm.backend pyslurm that is not usable
                out = DrainOutcome("failed", str(e))
            p.attempts += 1
            latency = time.monotonic() - p.seen_mono
            if p.run_id is None:
                p.run_id = self._record_run(p.seen_wall, "drain", p.reason, p.finding, [p.finding], latency)
            if out.outcome == "failed":
                wait = self._backoff
                self._next_attempt = time.monotonic() + wait
                self._backoff = min(self._backoff * 2, self.settings.retry_max_s)
                if p.attempts & (p.attempts - 1) == 0:  # attempts 1, 2, 4, 8, ...: loud but not a flood
                    self.log.error(f"watch {self.node}: drain for Xid {p.we.event.code} failed (attempt "
                                   f"{p.attempts}, retrying in {wait:g}s): {out.detail}")
                if not p.failure_recorded:
                    self._record_drain(p, "failed", out.detail, p.run_id)
                    p.failure_recorded = True
                return
            self.pending.remove(p)
            self._backoff = self.settings.retry_initial_s
            detail = out.detail
            if out.outcome == "done" and p.finding.action.value == "reboot" and \
                    (self.cfg.sections.get("reboot") or {}).get("auto"):
                from gpuguard.slurm.client import request_reboot

                rb = request_reboot(self._client_or_error(), self.node, p.reason)  # never raises
                detail = f"reboot {rb['outcome']}: {rb['detail']}"
            self._finish(p, out.outcome, detail, latency)
        self._persist_cursor()

    # ---------------------------------------------------------------- the store (failures are logged, never fatal)
    def _open_store(self) -> Any:
        if self._store is None:
            from gpuguard.store.sqlite import Store

            self._store = Store(store_path(self.cfg, self.node), timeout_s=5.0)
        return self._store

    def _close_store(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001
                pass
            self._store = None

    def _store_failed(self, what: str, e: Exception) -> None:
        self._close_store()
        now = time.monotonic()
        if now - self._store_error_logged > 60:
            self._store_error_logged = now
            self.log.error(f"watch {self.node}: history store error while {what}: {type(e).__name__}: {e}")

    def _record_run(self, started: float, verdict: str, reason: Optional[str], primary: Optional[Finding],
                    findings: list[Finding], latency_s: Optional[float]) -> Optional[int]:
        try:
            run_id = self._open_store().record_run(
                started=started, duration_ms=latency_s * 1000 if latency_s is not None else None, node=self.node,
                kind="watch", job_id=None, profile=None, verdict=verdict,
                action=primary.action.value if primary else None, reason=reason, exit_code=None, error=None,
                boot_id=self.boot_id, findings=findings)
        except Exception as e:  # noqa: BLE001
            self._store_failed("recording a run", e)
            return None
        self.recorded_runs += 1
        return int(run_id)

    def _record_drain(self, p: _Pending, outcome: str, detail: str, run_id: Optional[int]) -> None:
        self._record_drain_row(p.reason, CHECK_ID, p.finding.action.value, outcome, detail, run_id)

    def _record_drain_row(self, reason: str, check_id: Optional[str], action: str, outcome: str, detail: str,
                          run_id: Optional[int]) -> None:
        try:
            self._open_store().record_drain(node=self.node, op="drain", outcome=outcome, reason=reason,
                                            check_id=check_id, action=action, run_id=run_id, detail=detail)
        except Exception as e:  # noqa: BLE001
            self._store_failed("recording a drain", e)

    def _persist_cursor(self) -> None:
        # Held before the first fatal Xid whose drain is neither applied nor durable in the verdict journal: a
        # restart must judge it again. One in the journal stands there: the position may move past it.
        held = [p for p in self.pending if not p.journaled]
        cursor = held[0].before_cursor if held else self._latest_cursor
        if cursor is None or cursor == self._persisted:
            return
        try:  # the watch's own part of the journal (off the store's filesystem: a damaged store skips nothing)
            part = Journal.load(runtime_dir(self.cfg), self.node, part="watch")
            part.positions["watch"] = cursor
            part.save()
        except Exception:  # noqa: BLE001 - the store's copy below still holds it
            pass
        try:
            self._open_store().set_cursor(cursor_name(self.node), cursor)
        except Exception as e:  # noqa: BLE001
            self._store_failed("saving the cursor", e)
            return
        self._persisted = cursor


def _notify_enabled(cfg: Config) -> bool:
    """Any receiver configured (apprise URLs or Alertmanager)."""
    from gpuguard.notify import enabled

    return enabled(cfg) is not None


def _notify_drain(cfg: Config, node: str, p: _Pending, log: HookLog) -> None:
    """NOTIFY CALL SITE: the one place the watch tells people about a drain (gpuguard.notify: de-duplicated,
    grouped fleet-wide, spooled when undeliverable). In a thread: a slow webhook must not delay the next drain."""
    if not _notify_enabled(cfg):
        return
    try:
        from gpuguard.notify import Event, emit
    except ImportError:  # an installation without the notify module: draining is what matters
        return
    event = Event(kind="drain", node=node, message=f"{p.finding.message} (seen by gpuguard watch in the kernel log)",
                  severity="critical", check_id=CHECK_ID, action=p.finding.action.value, reason=p.reason,
                  evidence=dict(p.finding.evidence))

    def send() -> None:
        try:
            emit(cfg, event)  # bounded by its own budget, never raises
        except Exception as e:  # noqa: BLE001
            log.warning(f"watch {node}: notification failed: {type(e).__name__}: {e}")

    threading.Thread(target=send, name="gpuguard-watch-notify", daemon=True).start()


def _notify_pending_drain(cfg: Config, node: str, pd: Any, log: HookLog) -> None:
    """A hook's drain that the watch applied once slurmctld answered again."""
    if not _notify_enabled(cfg):
        return
    from gpuguard.notify import Event, emit

    event = Event(kind="drain", node=node, severity="critical", check_id=pd.check_id, action=pd.action,
                  reason=pd.reason, message=f"drained once slurmctld answered again (decided by the {pd.origin}): "
                                            f"{pd.reason}")
    threading.Thread(target=lambda: emit(cfg, event), name="gpuguard-watch-notify", daemon=True).start()


def _iso(ts: float) -> str:
    from gpuguard.util.timefmt import iso_utc

    return iso_utc(ts) or "?"


def _notify_flush(cfg: Config, log: HookLog) -> None:
    """Retry notifications that could not be delivered earlier (network down, webhook timing out)."""
    try:
        from gpuguard.notify import flush
    except ImportError:
        return
    try:
        flush(cfg)
    except Exception as e:  # noqa: BLE001
        log.warning(f"watch: retrying spooled notifications failed: {type(e).__name__}: {e}")


# --------------------------------------------------------------------------- the daemon


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
        from gpuguard.simulate.sources import resolve_sources

        if self.source_override:  # an explicit log: this host's boot, whatever the simulation config says
            return self.source_override, read_boot_id(cfg.sections["sources"]["boot_id_path"])
        sources = resolve_sources(cfg, self.node)
        if sources.simulated:
            spec = sources.kernel_log
        else:
            spec = self.settings.source or sources.kernel_log
        return spec, sources.boot_id or read_boot_id(sources.boot_id_path)

    def _stored_cursor(self) -> Optional[Cursor]:
        from gpuguard.store.sqlite import Store

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
        from gpuguard.xid.catalog import load_catalog

        return load_catalog(overrides=cfg.sections["xid"]["overrides"] or None)

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


# --------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("watch", help="daemon: follow the kernel log, drain within a second of a fatal Xid")
    _add_arguments(p)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config file (default $GPUGUARD_CONFIG or /etc/gpuguard/config.yaml)")
    p.add_argument("--node", help="Slurm node name (default: node.name, $SLURMD_NODENAME, the short hostname)")
    p.add_argument("--source", help="kernel log to follow: auto | kmsg[:PATH] | journal[:JOURNALCTL] | file:PATH "
                   "(default: watch.source, else sources.kernel_log)")
    p.add_argument("--once", action="store_true",
                   help="judge what is new since the cursor, drain if needed, and exit (1 if a drain failed)")
    p.add_argument("--agent", action="store_true",
                   help="also keep the node agent that runs the slurmd hooks without their start-up cost (docs/agent.md)")


_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def node_name(cfg: Config, explicit: Optional[str]) -> str:
    """--node, node.name, $SLURMD_NODENAME or the short hostname. It names the store file and goes to scontrol,
    so anything but a plain node name is refused."""
    from gpuguard.context import context_from_env

    name = context_from_env("manual", os.environ, node=explicit or cfg.sections["node"]["name"]).node
    if not _NODE_NAME.match(name):
        raise ValueError(f"invalid node name {name!r} (letters, digits, '.', '_' and '-' only)")
    return name


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)  # ConfigError: the CLI prints it and exits 2
    daemon = WatchDaemon(cfg, node=node_name(cfg, args.node), config_path=args.config, source=args.source,
                         once=args.once, agent=args.agent)
    daemon.install_signal_handlers()
    return daemon.run()


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m gpuguard.watch.daemon`: what the systemd unit runs. Same as `gpuguard watch`, without building the full
    command line (so no other feature module, broken or slow to import, can keep the node's guard from starting)."""
    ap = argparse.ArgumentParser(prog="gpuguard watch", description=__doc__.splitlines()[0] if __doc__ else None)
    _add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (ConfigError, ValueError) as e:
        print(f"gpuguard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
