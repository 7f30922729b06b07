"""The outbox: ship what the node's SQLite store recorded to the central PostgreSQL database, and prune the store.

Hooks never wait on the network: they record locally (gpuguard.store.sqlite) and are done. Shipping happens
- in the health check, after its verdict is recorded, for at most `store.ship_budget_s` (`ship_after_run`, in a
  thread the run stops waiting for when the budget is spent);
- in the watch daemon, every `store.ship_interval_s` (`ship_in_background`);
- from `gpuguard fleet ship` (a systemd timer; see docs/fleet.md).

Per table (drains first, the news that matters most; then runs with their problem findings) a watermark in the
store's `cursors` table (`fleet:shipped:<table>` = {"id": last shipped row id, "db": host:port/db, "streaks": the
repeats still open}) says how far shipping got. Rows above it are sent in batches, each batch in one PostgreSQL
transaction; the watermark moves only after the commit. Healthy runs become per-day counts and repeated problems
one row with a count (gpuguard.fleet.shipbatch); inserts are `ON CONFLICT DO NOTHING` on (origin, local id) and
counts are recomputed, never added: a shipper that dies between the commit and the watermark, or two shippers
racing, send rows twice and store them once. When the database is down nothing moves, the hooks go on recording,
and the next ship sends the backlog. A ship with nothing waiting opens no connection; the watch daemon and
`fleet ship` reuse theirs (`ConnectionKeeper`).

Retention (`store.retention_days`) prunes the store in bounded batches from the health check, once an hour and
again at once while a batch still removed rows (gpuguard.store.retention); never rows that are not shipped yet
when a url is configured, never less than `reboot.window_days` (escalation reads that far).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from gpuguard.fleet.pg import FleetDBError, clean_error
from gpuguard.fleet.schema import open_fleet_db
from gpuguard.fleet.shipbatch import execute, plan_drains, plan_runs
from gpuguard.fleet.url import db_fingerprint, redact_url
from gpuguard.store.retention import RETENTION_CURSOR, batch_record
from gpuguard.store.sqlite import Store

ORIGIN_CURSOR = "fleet:origin"
TABLES = ("drains", "runs")  # drains first: they are few and they are the news
BATCH = 500
PRUNE_BATCH = 2000


def watermark_name(table: str) -> str:
    return f"fleet:shipped:{table}"


@dataclass
class ShipResult:
    store: str
    origin: Optional[str] = None
    sent: dict[str, int] = field(default_factory=lambda: {"drains": 0, "runs": 0, "findings": 0})
    backlog: dict[str, int] = field(default_factory=dict)  # rows still waiting in the store
    pruned: dict[str, int] = field(default_factory=dict)
    error: Optional[str] = None

    @property
    def complete(self) -> bool:
        return self.error is None and not any(self.backlog.values())

    def as_dict(self) -> dict[str, Any]:
        return {"store": self.store, "origin": self.origin, "sent": self.sent, "backlog": self.backlog,
                "pruned": self.pruned, "error": self.error, "complete": self.complete}

    def summary(self) -> str:
        s = self.sent
        text = f"{self.store}: shipped {s['drains']} drain(s), {s['runs']} run(s), {s['findings']} finding(s)"
        if any(self.backlog.values()):
            text += "; waiting: " + ", ".join(f"{n} {t}" for t, n in self.backlog.items() if n)
        if any(self.pruned.values()):
            text += "; pruned: " + ", ".join(f"{n} {t}" for t, n in self.pruned.items() if n)
        return text + (f"; ERROR {self.error}" if self.error else "")


# --------------------------------------------------------------------------- shipping one store


def origin_of(store: Any) -> str:
    """This store's origin id, created on first use (kept in its cursors table; a recreated store gets a new one)."""
    value = store.setdefault_cursor(ORIGIN_CURSOR, {"id": str(uuid.uuid4()), "created": time.time()})
    return str(uuid.UUID(str(value["id"])))


def watermark(store: Any, table: str, db: str) -> tuple[int, dict[str, Any]]:
    """(last shipped id, the repeat streaks open at it) for `table`; (0, {}) when none or another database's."""
    wm = store.get_cursor(watermark_name(table)) or {}
    if wm.get("db") != db:
        return 0, {}
    try:
        shipped = int(wm.get("id") or 0)
    except (TypeError, ValueError):
        return 0, {}
    streaks = wm.get("streaks")
    return shipped, streaks if isinstance(streaks, dict) else {}


def shipped_up_to(store: Any, table: str, db: str) -> int:
    """The watermark for `table`, 0 when none or when it belongs to another database."""
    return watermark(store, table, db)[0]


def backlog_of(store: Any, db: str) -> dict[str, int]:
    return {t: store.count_after(t, shipped_up_to(store, t, db)) for t in TABLES}


def _ship_batch(conn: Any, store: Any, origin: str, table: str, rows: list[dict[str, Any]],
                streaks: dict[str, Any]) -> int:
    """One batch in one transaction; returns the findings written."""
    if table == "drains":
        plan = plan_drains(origin, rows, streaks)
    else:
        found = store.problem_findings(rows[0]["id"], rows[-1]["id"])
        by_run: dict[int, list[dict[str, Any]]] = {}
        for f in found:
            by_run.setdefault(int(f["run_id"]), []).append(f)
        plan = plan_runs(origin, rows, by_run, streaks)
    with conn.transaction():
        return execute(conn.cursor(), origin, plan, store, int(rows[-1]["id"]))


def ship_store(store: Any, conn: Any, db: str, *, deadline: float, batch: int = BATCH,
               result: Optional[ShipResult] = None) -> ShipResult:
    """Send the store's unshipped drains and runs (with problem findings) until done or `deadline`
    (time.monotonic()). Database errors end up in result.error; nothing is lost either way."""
    res = result or ShipResult(store=store.path)
    origin = res.origin = origin_of(store)
    try:
        with conn.transaction():
            conn.execute("INSERT INTO gpuguard.origins (origin, host, store_path) VALUES (%s,%s,%s) "
                         "ON CONFLICT (origin) DO UPDATE SET last_ship=now(), host=excluded.host, "
                         "store_path=excluded.store_path", (origin, socket.gethostname()[:200], store.path[:1000]))
        for table in TABLES:
            after, streaks = watermark(store, table, db)
            while time.monotonic() < deadline:
                rows = store.rows_after(table, after, batch)
                if not rows:
                    break
                res.sent["findings"] += _ship_batch(conn, store, origin, table, rows, streaks)
                after = int(rows[-1]["id"])
                store.advance_watermark(watermark_name(table), {"id": after, "db": db, "at": time.time(),
                                                                "streaks": streaks})
                res.sent[table] += len(rows)
    except Exception as e:  # noqa: BLE001 - psycopg / sqlite errors: report, keep the backlog
        res.error = f"{type(e).__name__}: {clean_error(e, '')}"
        try:
            conn.rollback()
        except Exception:  # noqa: BLE001
            pass
    try:
        res.backlog = backlog_of(store, db)
    except Exception:  # noqa: BLE001
        pass
    return res


class ConnectionKeeper:
    """Reuses one connection per database across ships in a long-lived process (the watch daemon; `fleet ship`
    over many stores), instead of one new connection per ship. A ship with nothing to send opens none and closes
    the kept one, so an idle node holds no connection; a connection that fails is dropped and the next ship opens
    a new one. Thread-safe: a connection is lent to one ship at a time."""

    def __init__(self) -> None:
        self._idle: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.opened = 0  # connections opened, for tests and docs

    def take(self, url: str, opener: Any) -> Any:
        with self._lock:
            conn = self._idle.pop(url, None)
        if conn is not None:
            try:
                conn.execute("SELECT 1")
                conn.rollback()
                return conn
            except Exception:  # noqa: BLE001 - the server went away: open a new one
                _close(conn)
        conn = opener()
        self.opened += 1
        return conn

    def give_back(self, url: str, conn: Any, healthy: bool) -> None:
        if not healthy:
            _close(conn)
            return
        with self._lock:
            old, self._idle[url] = self._idle.get(url), conn
        if old is not None and old is not conn:
            _close(old)

    def release(self, url: Optional[str] = None) -> None:
        """Close the kept connection(s): nothing to ship, or the process ends."""
        with self._lock:
            conns = [self._idle.pop(u) for u in list(self._idle) if url is None or u == url]
        for conn in conns:
            _close(conn)


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001
        pass


def ship_path(cfg: Any, path: str, budget_s: float, *, prune: bool = False,
              keeper: Optional[ConnectionKeeper] = None) -> ShipResult:
    """Open the store at `path`, prune it (if asked and configured), ship it (if store.url is set and something
    waits: no connection is opened for nothing). With a `keeper`, the connection is reused."""
    scfg = cfg.store
    url = scfg.url
    until = time.monotonic() + budget_s
    res = ShipResult(store=path)
    try:
        store = Store(path, timeout_s=max(0.5, min(2.0, budget_s / 2)))
    except Exception as e:  # noqa: BLE001 - StoreUnavailable and friends
        res.error = f"store: {e}"
        return res
    try:
        if prune and scfg.retention_days:
            res.pruned = prune_store(cfg, store)
            store.set_cursor(RETENTION_CURSOR, batch_record(time.time(), res.pruned))
        if not url:
            return res
        db = db_fingerprint(url)
        res.backlog = backlog_of(store, db)
        if not any(res.backlog.values()):
            if keeper is not None:
                keeper.release(url)
            return res
        _ship_with_connection(url, store, db, until, budget_s, res, keeper)
        return res
    finally:
        store.close()


def _ship_with_connection(url: str, store: Any, db: str, until: float, budget_s: float, res: ShipResult,
                          keeper: Optional[ConnectionKeeper]) -> None:
    def opener() -> Any:
        return open_fleet_db(url, timeout_s=max(1.0, until - time.monotonic()),
                             statement_timeout_s=max(1.0, min(30.0, budget_s)), application_name="gpuguard-ship")

    try:
        conn = keeper.take(url, opener) if keeper is not None else opener()
    except FleetDBError as e:
        res.error = str(e)
        return
    try:
        ship_store(store, conn, db, deadline=until, result=res)
    finally:
        if keeper is not None:
            keeper.give_back(url, conn, healthy=res.error is None)
        else:
            _close(conn)
    if res.error:
        res.error = f"{redact_url(url)}: {res.error}"


def prune_store(cfg: Any, store: Any, now: Optional[float] = None, batch: int = PRUNE_BATCH) -> dict[str, int]:
    """One bounded retention batch. Never below reboot.window_days; with store.url, only shipped rows."""
    scfg = cfg.store
    days = max(float(scfg.retention_days), float(cfg.reboot.window_days))
    now = time.time() if now is None else now
    shipped = None
    if scfg.url:
        db = db_fingerprint(scfg.url)
        shipped = {t: shipped_up_to(store, t, db) for t in TABLES}
    return store.prune_history(now - days * 86400, batch, shipped)


# --------------------------------------------------------------------------- callers


def ship_after_run(cfg: Any, result: Any, deadline: Any, *, prune: bool) -> Optional[ShipResult]:
    """The health check, after its verdict is recorded: prune a batch (`prune`: retention is set and a batch is
    due, gpuguard.store.retention) and ship, for at most store.ship_budget_s (and never into the last second of
    the run's deadline). The work runs in a daemon thread: a database that hangs costs the health check the
    budget, not its deadline. Problems become notes in the run's log line."""
    scfg = cfg.store
    if not scfg.url and not prune:
        return None
    budget = min(float(scfg.ship_budget_s), deadline.remaining() - 1.0)
    if budget < 0.2:
        return None
    path = scfg.path_for(result.context.node)
    box: dict[str, ShipResult] = {}

    def work() -> None:
        box["result"] = ship_path(cfg, path, budget, prune=prune)

    t = threading.Thread(target=work, name="gpuguard-fleet-ship", daemon=True)
    t.start()
    t.join(budget + 0.25)
    res = box.get("result")
    if res is None:
        result.notes.append(f"central history: shipping did not finish within {budget:.1f}s (store.ship_budget_s); "
                            "the rows stay in the local store for the next ship")
    elif res.error:
        waiting = ", ".join(f"{n} {t}" for t, n in res.backlog.items() if n) or "nothing"
        result.notes.append(f"central history not updated ({res.error}); waiting in the local store: {waiting}")
    return res


_background: dict[str, threading.Thread] = {}


def wait_for_background_ship(cfg: Any, node: str, timeout_s: float) -> bool:
    """Wait for the node's background ship (if one is running); True when none is left running."""
    t = _background.get(cfg.store.path_for(node))
    if t is not None:
        t.join(timeout_s)
    return t is None or not t.is_alive()
BACKGROUND_KEEPER = ConnectionKeeper()  # the watch daemon's connection, reused from ship to ship


def ship_in_background(cfg: Any, node: str, budget_s: float = 30.0) -> bool:
    """The watch daemon's periodic ship: one thread per store at a time; returns False when one is still going.
    It reuses its connection, and opens none while the health check has already shipped everything."""
    path = cfg.store.path_for(node)
    running = _background.get(path)
    if running is not None and running.is_alive():
        return False
    t = threading.Thread(target=ship_path, args=(cfg, path, budget_s), kwargs={"keeper": BACKGROUND_KEEPER},
                         name="gpuguard-fleet-ship", daemon=True)
    _background[path] = t
    t.start()
    return True
