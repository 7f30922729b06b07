"""The outbox: ship what the node's SQLite store recorded to the central PostgreSQL database, and prune the store.

Hooks never wait on the network: they record locally (gpuguard.store) and are done. Shipping happens
- in the health check, after its verdict is recorded, for at most `store.ship_budget_s` (`ship_after_run`, in a
  thread the run stops waiting for when the budget is spent);
- in the watch daemon, every `store.ship_interval_s` (`ship_in_background`);
- from `gpuguard fleet ship` (a systemd timer; see docs/fleet.md).

Per table (drains first, the news that matters most; then runs with their problem findings) a watermark in the
store's `cursors` table (`fleet:shipped:<table>` = {"id": last shipped row id, "db": host:port/db}) says how far
shipping got. Rows above it are sent in batches, each batch in one PostgreSQL transaction; the watermark moves
only after the commit. Inserts are `ON CONFLICT DO NOTHING` on (origin, local id): a shipper that dies between the
commit and the watermark, or two shippers racing, send rows twice and store them once. When the database is down
nothing moves, the hooks go on recording, and the next ship sends the backlog.

Retention (`store.retention_days`) prunes the store in bounded batches from the health check; never rows that
are not shipped yet when a url is configured, never less than `reboot.window_days` (escalation reads that far).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

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


# --------------------------------------------------------------------------- rows -> PostgreSQL parameters


def _ts(value: Any) -> datetime:
    return datetime.fromtimestamp(float(value), timezone.utc)


def _int(value: Any) -> Optional[int]:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _evidence(text: Any) -> Any:
    from psycopg.types.json import Jsonb

    from gpuguard.fleet.pg import clean_json

    if text is None or text == "":
        return None
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        value = {"raw": str(text)}
    return Jsonb(clean_json(value))


def run_params(origin: str, r: dict[str, Any]) -> tuple[Any, ...]:
    from gpuguard.fleet.pg import clean_text as t

    return (origin, int(r["id"]), t(r["node"]), _ts(r["started"]), r.get("duration_ms"), t(r["kind"]),
            t(r.get("job_id")), _int(r.get("restart_count")), t(r.get("profile")), t(r["verdict"]), t(r.get("action")),
            t(r.get("reason")), _int(r.get("exit_code")), t(r.get("error")), t(r.get("boot_id")))


def finding_params(origin: str, run: dict[str, Any], seq: int, f: dict[str, Any]) -> tuple[Any, ...]:
    from gpuguard.fleet.pg import clean_text as t

    return (origin, int(run["id"]), seq, t(run["node"]), _ts(run["started"]), t(f["check_id"]), t(f["severity"]),
            t(f.get("keyword")), _int(f.get("gpu")), t(f.get("action")), t(f.get("message")),
            t(f.get("remediation")), _evidence(f.get("evidence")))


def drain_params(origin: str, d: dict[str, Any]) -> tuple[Any, ...]:
    from gpuguard.fleet.pg import clean_text as t
    from gpuguard.fleet.query import keyword_of_reason

    return (origin, int(d["id"]), t(d["node"]), _ts(d["ts"]), t(d["op"]), t(d["outcome"]), t(d.get("reason")),
            t(d.get("check_id")), t(keyword_of_reason(d.get("reason"))), t(d.get("action")), _int(d.get("run_id")),
            t(d.get("detail")))


INSERT_RUN = ("INSERT INTO gpuguard.runs (origin, local_id, node, started, duration_ms, kind, job_id, restart_count, "
              "profile, verdict, action, reason, exit_code, error, boot_id) VALUES "
              "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING")
INSERT_FINDING = ("INSERT INTO gpuguard.findings (origin, run_local_id, seq, node, started, check_id, severity, "
                  "keyword, gpu, action, message, remediation, evidence) VALUES "
                  "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING")
INSERT_DRAIN = ("INSERT INTO gpuguard.drains (origin, local_id, node, ts, op, outcome, reason, check_id, keyword, "
                "action, run_local_id, detail) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING")


# --------------------------------------------------------------------------- shipping one store


def origin_of(store: Any) -> str:
    """This store's origin id, created on first use (kept in its cursors table; a recreated store gets a new one)."""
    value = store.setdefault_cursor(ORIGIN_CURSOR, {"id": str(uuid.uuid4()), "created": time.time()})
    return str(uuid.UUID(str(value["id"])))


def shipped_up_to(store: Any, table: str, db: str) -> int:
    """The watermark for `table`, 0 when none or when it belongs to another database."""
    wm = store.get_cursor(watermark_name(table)) or {}
    if wm.get("db") != db:
        return 0
    try:
        return int(wm.get("id") or 0)
    except (TypeError, ValueError):
        return 0


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
            after = shipped_up_to(store, table, db)
            while time.monotonic() < deadline:
                rows = store.rows_after(table, after, batch)
                if not rows:
                    break
                with conn.transaction():
                    cur = conn.cursor()
                    if table == "drains":
                        cur.executemany(INSERT_DRAIN, [drain_params(origin, d) for d in rows])
                    else:
                        cur.executemany(INSERT_RUN, [run_params(origin, r) for r in rows])
                        found = store.problem_findings(rows[0]["id"], rows[-1]["id"])
                        if found:
                            by_id = {r["id"]: r for r in rows}
                            seqs: dict[int, int] = {}
                            params = []
                            for f in found:
                                run = by_id.get(f["run_id"])
                                if run is None:
                                    continue
                                seq = seqs[f["run_id"]] = seqs.get(f["run_id"], -1) + 1
                                params.append(finding_params(origin, run, seq, f))
                            cur.executemany(INSERT_FINDING, params)
                            res.sent["findings"] += len(params)
                after = int(rows[-1]["id"])
                store.advance_watermark(watermark_name(table), {"id": after, "db": db, "at": time.time()})
                res.sent[table] += len(rows)
    except Exception as e:  # noqa: BLE001 - psycopg / sqlite errors: report, keep the backlog
        from gpuguard.fleet.pg import _clean_error

        res.error = f"{type(e).__name__}: {_clean_error(e, '')}"
        try:
            conn.rollback()
        except Exception:  # noqa: BLE001
            pass
    for table in TABLES:
        try:
            res.backlog[table] = store.count_after(table, shipped_up_to(store, table, db))
        except Exception:  # noqa: BLE001
            pass
    return res


def ship_path(cfg: Any, path: str, budget_s: float, *, prune: bool = False) -> ShipResult:
    """Open the store at `path`, prune it (if asked and configured), ship it (if store.url is set)."""
    from gpuguard.fleet.pg import FleetDBError, open_fleet_db
    from gpuguard.fleet.url import db_fingerprint, redact_url
    from gpuguard.store import Store

    scfg = cfg.sections["store"]
    url = scfg.get("url")
    until = time.monotonic() + budget_s
    res = ShipResult(store=path)
    try:
        store = Store(path, timeout_s=max(0.5, min(2.0, budget_s / 2)))
    except Exception as e:  # noqa: BLE001 - StoreUnavailable and friends
        res.error = f"store: {e}"
        return res
    try:
        if prune and scfg.get("retention_days"):
            res.pruned = prune_store(cfg, store)
        if not url:
            return res
        db = db_fingerprint(url)
        try:
            conn = open_fleet_db(url, timeout_s=max(1.0, until - time.monotonic()),
                                 statement_timeout_s=max(1.0, min(30.0, budget_s)),
                                 application_name="gpuguard-ship")
        except FleetDBError as e:
            res.error = str(e)
            for table in TABLES:
                res.backlog[table] = store.count_after(table, shipped_up_to(store, table, db))
            return res
        try:
            ship_store(store, conn, db, deadline=until, result=res)
        finally:
            conn.close()
        if res.error:
            res.error = f"{redact_url(url)}: {res.error}"
        return res
    finally:
        store.close()


def prune_store(cfg: Any, store: Any, now: Optional[float] = None, batch: int = PRUNE_BATCH) -> dict[str, int]:
    """One bounded retention batch. Never below reboot.window_days; with store.url, only shipped rows."""
    from gpuguard.fleet.url import db_fingerprint

    scfg = cfg.sections["store"]
    days = max(float(scfg["retention_days"]), float(cfg.sections["reboot"]["window_days"]))
    now = time.time() if now is None else now
    shipped = None
    if scfg.get("url"):
        db = db_fingerprint(scfg["url"])
        shipped = {t: shipped_up_to(store, t, db) for t in TABLES}
    return store.prune_history(now - days * 86400, batch, shipped)


# --------------------------------------------------------------------------- callers


def ship_after_run(cfg: Any, result: Any, deadline: Any) -> Optional[ShipResult]:
    """The health check, after its verdict is recorded: prune a batch and ship, for at most store.ship_budget_s
    (and never into the last second of the run's deadline). The work runs in a daemon thread: a database that
    hangs costs the health check the budget, not its deadline. Problems become notes in the run's log line."""
    scfg = cfg.sections["store"]
    if not scfg.get("url") and not scfg.get("retention_days"):
        return None
    budget = min(float(scfg["ship_budget_s"]), deadline.remaining() - 1.0)
    if budget < 0.2:
        return None
    path = scfg["path"].replace("{node}", result.context.node)
    box: dict[str, ShipResult] = {}

    def work() -> None:
        box["result"] = ship_path(cfg, path, budget, prune=True)

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


def ship_in_background(cfg: Any, node: str, budget_s: float = 30.0) -> bool:
    """The watch daemon's periodic ship: one thread per store at a time; returns False when one is still going."""
    path = cfg.sections["store"]["path"].replace("{node}", node)
    running = _background.get(path)
    if running is not None and running.is_alive():
        return False
    t = threading.Thread(target=ship_path, args=(cfg, path, budget_s), name="gpuguard-fleet-ship", daemon=True)
    _background[path] = t
    t.start()
    return True
