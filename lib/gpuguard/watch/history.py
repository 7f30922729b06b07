"""The drain worker's writes to the node's history store (runs, drains, its kernel-log position). The store is
opened lazily and kept open; any failure is logged (at most once a minute) and never stops a drain."""

from __future__ import annotations

import time
from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.kernellog.base import StoredCursor
from gpuguard.model import Finding
from gpuguard.pipeline.journal import Journal, runtime_dir
from gpuguard.store.sqlite import Store
from gpuguard.util.log import HookLog
from gpuguard.watch.judge import CHECK_ID
from gpuguard.watch.pending import PendingEvent
from gpuguard.watch.settings import cursor_name, store_path


class HistoryWrites:
    """The store half of `gpuguard.watch.worker.DrainWorker` (a mixin: the worker's __init__ sets these)."""

    cfg: Config
    node: str
    boot_id: Optional[str]
    log: HookLog
    pending: list[PendingEvent]
    recorded_runs: int
    _store: Any
    _store_error_logged: float
    _latest_cursor: Optional[StoredCursor]
    _persisted: Optional[StoredCursor]

    def _open_store(self) -> Any:
        if self._store is None:
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

    def _record_drain(self, p: PendingEvent, outcome: str, detail: str, run_id: Optional[int]) -> None:
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
