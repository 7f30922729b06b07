"""The drain worker: one thread that owns the Slurm client and the history store, so a hung slurmctld or a slow
store never stops the kernel log from being followed (gpuguard.watch.loop reads and judges; this acts).

A fatal Xid's drain is written to the node's verdict journal (gpuguard.pipeline.journal) before Slurm is asked,
then applied through gpuguard.pipeline.act (ownership rules: never over someone else's node); without a usable
journal it is held in memory, and the kernel-log position before it. A failed attempt is retried with exponential
back-off until it resolves (done / already / foreign).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Iterator, Optional

from gpuguard.config.schema import Config
from gpuguard.fleet.ship import ship_in_background
from gpuguard.kernellog.base import StoredCursor
from gpuguard.model import Action, Finding
from gpuguard.pipeline.act import SlurmHandle, new_pending, retry_pending
from gpuguard.pipeline.conditions import conditions_from_verdict, mark_applied, merge, standing
from gpuguard.pipeline.journal import Journal, journal_for, runtime_dir
from gpuguard.pipeline.lock import NodeLock, lock_path
from gpuguard.pipeline.policy import escalate_recurring
from gpuguard.pipeline.reconcile import agree
from gpuguard.probes.system import read_driver_fingerprint
from gpuguard.simulate.sources import resolve_sources
from gpuguard.slurm.client import DrainOutcome, SlurmError, client_from_config, drain_node, request_reboot
from gpuguard.util.log import HookLog
from gpuguard.util.timefmt import iso_utc
from gpuguard.watch.history import HistoryWrites
from gpuguard.watch.judge import CHECK_ID, WatchEvent, node_verdict
from gpuguard.watch.pending import DrainOutcomeRecord, PendingEvent
from gpuguard.watch.settings import WatchSettings, store_path
from gpuguard.watch.tell import notify_drain, notify_enabled, notify_flush, notify_pending_drain

Cursor = StoredCursor

NOTIFY_FLUSH_S = 60.0  # how often undelivered notifications are retried (only when notify.urls is set)


class DrainWorker(HistoryWrites, threading.Thread):
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
        self.pending: list[PendingEvent] = []
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
        self._next_agree = time.monotonic()  # standing conditions: Slurm is made to agree every watch.agree_s
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
            if notify_enabled(self.cfg):
                due.append(self._next_flush)
            if self.cfg.store.url:
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
                if self.cfg.store.url and time.monotonic() >= self._next_ship:
                    self._next_ship = time.monotonic() + self.cfg.store.ship_interval_s
                    ship_in_background(self.cfg, self.node)  # its own thread, store and connection
                if self.pending and time.monotonic() >= self._next_attempt:
                    self._attempt()
                elif not self.pending and time.monotonic() >= self._next_peek:
                    self._peek_journal()
                if notify_enabled(self.cfg) and time.monotonic() >= self._next_flush:
                    self._next_flush = time.monotonic() + NOTIFY_FLUSH_S
                    if self._flusher is None or not self._flusher.is_alive():
                        self._flusher = threading.Thread(target=notify_flush, args=(self.cfg, self.log),
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
        p = PendingEvent(we, verdict.reason, finding, before, seen_wall, seen_mono)
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
            yield journal_for(self.cfg, self.node) if locked else None

    def _journal_pending(self, p: PendingEvent, verdict: Any, seen_wall: float) -> None:
        """The drain stands until applied: recorded as pending before Slurm is asked, so a restart, a prolog (which
        refuses jobs meanwhile) or the next health check carries it on even if this daemon dies."""
        try:
            with self._shared_journal() as j:
                if j is None:
                    return
                # the Xid becomes a condition of the node in the same write: it stands until what clears it is seen
                found = conditions_from_verdict(verdict, "watch", seen_wall, self.boot_id,
                                                driver_fp=self._driver_fp())
                j.conditions, _ = merge(j.conditions, found)
                entry = j.add_pending(new_pending(verdict, "watch", seen_wall))
                if j.save() is None:
                    p.pending_id, p.journaled = entry.id, True
        except Exception as e:  # noqa: BLE001 - the in-memory pending and the held cursor still stand
            self.log.error(f"watch {self.node}: cannot write the verdict journal: {type(e).__name__}: {e}")

    def _driver_fp(self) -> Optional[str]:
        """The loaded nvidia module now (a later, different one is a GPU reset: gpuguard.pipeline.conditions)."""
        try:
            return read_driver_fingerprint(resolve_sources(self.cfg, self.node).sysfs_root)
        except Exception:  # noqa: BLE001 - unknown: the condition then waits for the store's view or a reboot
            return None

    def _peek_journal(self) -> None:
        """Drains a hook decided but could not apply (slurmctld was down) are retried here as well."""
        self._next_peek = time.monotonic() + max(self.settings.retry_initial_s, min(5.0, self.settings.agree_s))
        try:
            j = journal_for(self.cfg, self.node)
        except Exception:  # noqa: BLE001
            return
        self.journal_pending = len(j.pending)
        if j.pending:
            self._attempt_journal()
        elif standing(j.conditions) and time.monotonic() >= self._next_agree:
            self._agree()

    def _agree(self) -> None:
        """While a condition stands, Slurm is made to agree every watch.agree_s (gpuguard.pipeline.reconcile): a
        plain resume is drained again within that, without waiting for the next health check or prolog."""
        self._next_agree = time.monotonic() + self.settings.agree_s
        with self._shared_journal() as j:
            if j is None:
                return
            out = agree(j, SlurmHandle(self.cfg, None, self._client_or_error()), self.node, time.time())
            j.save()
        if out["outcome"] in ("applied", "redrained", "replaced", "cleared"):
            self.log.error(f"watch {self.node}: {out.get('detail')}" + (f": {out['reason']}" if out.get("reason")
                                                                         else ""))
        elif out["outcome"] == "pending":
            self.log.error(f"watch {self.node}: a condition stands and Slurm cannot be told: {out.get('detail')}")

    def _escalated(self, finding: Finding) -> Finding:
        """As the prolog and health check do: a reboot/reset-class Xid that already drained this node in
        `reboot.escalate_after` earlier boots is not fixed by rebooting: action replace."""
        rcfg = self.cfg.reboot
        after = int(rcfg.escalate_after or 0)
        if not after or finding.action not in (Action.REBOOT, Action.RESET):
            return finding
        try:
            since = time.time() - float(rcfg.window_days) * 86400
            seen = self._open_store().previous_fault_boots(self.node, CHECK_ID, finding.keyword, self.boot_id, since)
        except Exception as e:  # noqa: BLE001 - no history: drain with the catalog's action
            self._store_failed("reading earlier drains", e)
            return finding
        return escalate_recurring([finding], {(CHECK_ID, finding.keyword): seen}, after)[0]

    def _client_or_error(self) -> Any:
        if self._client is None:
            self._client = client_from_config(self.cfg.slurm, self.settings.scontrol_s)
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
        with self._shared_journal() as j:
            if j is None:
                self._next_attempt = time.monotonic() + 1.0
                return
            handle = SlurmHandle(self.cfg, None, self._client_or_error())
            applied = retry_pending(j, handle, self.node, self.cfg.reboot.auto)
            if any(a["outcome"] in ("done", "already", "foreign") for a in applied):
                mark_applied(j.conditions)
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
                notify_pending_drain(self.cfg, self.node, pd, self.log)
            return
        self.pending.remove(own)
        own.attempts = pd.attempts + 1
        latency = time.monotonic() - own.seen_mono
        if own.run_id is None:
            own.run_id = self._record_run(own.seen_wall, "drain", own.reason, own.finding, [own.finding], latency)
        self._finish(own, a["outcome"], a["detail"], latency)

    def _finish(self, p: PendingEvent, outcome: str, detail: str, latency: float) -> None:
        self._record_drain(p, outcome, detail, p.run_id)
        self.outcomes.append(DrainOutcomeRecord(p.reason, outcome, detail, p.attempts, latency))
        level = "error" if outcome == "done" else "warning"
        self.log.log(level, f"watch {self.node}: Xid {p.we.event.code} on {p.we.event.pci}: drain {outcome} "
                     f"{latency:.3f}s after the log line was read: {p.reason}" + (f" ({detail})" if detail else ""))
        if outcome == "done":
            notify_drain(self.cfg, self.node, p, self.log)

    def _attempt_direct(self) -> None:
        """Without a usable verdict journal: the drain is held in memory and the cursor before it."""
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
                    self.cfg.reboot.auto:
                rb = request_reboot(self._client_or_error(), self.node, p.reason)  # never raises
                detail = f"reboot {rb['outcome']}: {rb['detail']}"
            self._finish(p, out.outcome, detail, latency)
        self._persist_cursor()


def _iso(ts: float) -> str:
    return iso_utc(ts) or "?"
