"""Delivery: the spool (`notify_spool`: one row per message, with the targets it has still to reach) and the
worker thread that delivers rows to apprise URLs and Alertmanagers. Targets are named by a hash of their URL:
URLs carry tokens and passwords, the spool file should not. A failed target is retried by `flush()` with
exponential back-off (30 s ... 1 h); every time comes from the caller (`now`)."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from gpuguard.model import Handoff
from gpuguard.notify import amstate, claim
from gpuguard.notify.alertmanager import PostError, post_alerts
from gpuguard.notify.apprise_target import send_apprise
from gpuguard.config.sections.notify import NotifyConfig
from gpuguard.notify.event import Event
from gpuguard.notify.state import DeliveryLog, log_warning
from gpuguard.util.redact import scrub


@dataclass(frozen=True)
class Target:
    kind: str  # apprise | alertmanager
    url: str


@dataclass
class Row:
    id: int
    title: str
    body: str
    severity: str
    targets: list[str]
    key: Optional[str]
    state: str
    attempts: int = 0  # delivery attempts before this one


def url_id(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def targets_of(ncfg: NotifyConfig) -> dict[str, Target]:
    out = {url_id(u): Target("apprise", u) for u in ncfg.urls or []}
    out.update({url_id("alertmanager:" + u): Target("alertmanager", u) for u in ncfg.alertmanager_urls or []})
    return out


def spool(conn: Any, event: Optional[Event], title: str, body: str, targets: list[str], status: str, now: float,
          severity: Optional[str] = None, key: Optional[str] = None, state: Optional[str] = None) -> int:
    ev_json = None
    if event is not None:
        d = asdict(event)
        d["state"] = "resolved" if event.resolved else "firing"
        ev_json = json.dumps(d, default=str)
    cur = conn.execute(
        "INSERT INTO notify_spool(created,kind,node,check_id,severity,title,body,targets,status,next_try,event,"
        "dedup_key,state) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (now, event.kind if event else "digest", event.node if event else None, event.check_id if event else None,
         severity or (event.severity if event else "warning"), title, body, json.dumps(targets), status, now,
         ev_json, key, state or ("resolved" if event is not None and event.resolved else "firing")))
    return int(cur.lastrowid or 0)


def due_rows(conn: Any, now: float, limit: int = 50) -> list[Row]:
    return [Row(i, t, b, s or "warning", json.loads(tg), k, st or "firing", n or 0)
            for i, t, b, s, tg, k, st, n in conn.execute(
        "SELECT id, title, body, severity, targets, dedup_key, state, attempts FROM notify_spool "
        "WHERE status='pending' AND next_try<=? ORDER BY id LIMIT ?", (now, limit))]


@dataclass
class Job:
    """What one worker thread delivers: spooled rows, then keep-alive posts of firing Alertmanager alerts."""
    path: str
    rows: list[Row]
    targets: dict[str, Target]
    now: float
    timeout_s: float
    ttl_s: float
    keepalive: list[str]
    taken: dict[str, Optional[float]] = field(default_factory=dict)  # keep-alives taken: their last post before
    token: str = field(default_factory=claim.new_token)  # this job's claims on spool rows
    log: Optional[DeliveryLog] = None  # where each failed attempt is logged besides syslog (logging.file)


ERROR_PER_TARGET = 300  # characters of one receiver's error kept in the spool (`last_error`: one line each)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _post(conn: Any, url: str, keys: list[str], job: Job) -> tuple[bool, Optional[str]]:
    alerts = amstate.payload(conn, keys, job.now, job.ttl_s)
    if not alerts:
        return True, None
    try:
        post_alerts(url, alerts, job.timeout_s)
    except PostError as e:
        return e.permanent, str(e)
    return True, None


def _deliver_row(conn: Any, row: Row, job: Job) -> Optional[bool]:
    """Deliver one spooled row under a claim (gpuguard.notify.claim). None: another worker has it, or it is no
    longer pending; else whether every target took it."""
    owed = claim.claim(conn, row.id, job.token, job.now)
    if owed is None:
        return None
    left, errors, am_ok = list(owed), [], True
    for tid in owed:
        t = job.targets.get(tid)
        if t is None:
            left.remove(tid)
            continue  # that URL was removed from the config: nobody to deliver to
        if t.kind == "apprise":
            ok, err = send_apprise(t.url, row.title, row.body, row.severity, row.key, row.state, job.timeout_s)
        else:
            ok, err = _post(conn, t.url, [row.key] if row.key else [], job)
            am_ok = am_ok and ok and not err
        if err:
            # each receiver's error bounded on its own: every receiver that failed stays named (gpuguard status)
            errors.append(_cut(f"#{tid}: {scrub(err, [t.url])}", ERROR_PER_TARGET))
            # permanent (a wrong URL, refused credentials): not retried, so say so
            (job.log or DeliveryLog()).failed(row.title, row.attempts + 1, errors[-1], retried=not ok)
        if ok:
            left.remove(tid)
            claim.reached(conn, row.id, job.token, left)
    if am_ok and row.key and any(job.targets.get(t, Target("", "")).kind == "alertmanager" for t in owed):
        amstate.mark_posted(conn, [row.key], job.now)
    claim.finish(conn, row.id, job.token, left, "\n".join(errors) or None, job.now)
    return not left


def _keepalive(conn: Any, job: Job) -> None:
    ams = [t for t in job.targets.values() if t.kind == "alertmanager"]
    if not job.keepalive or not ams:
        return
    results = [_post(conn, t.url, job.keepalive, job) for t in ams]
    if all(ok and not err for ok, err in results):
        amstate.mark_posted(conn, job.keepalive, job.now)
    else:  # the flush took these keep-alives (amstate.take_keepalives): give them back for the next one
        amstate.return_keepalives(conn, job.keepalive, job.taken, job.now)
    for t, (_, err) in zip(ams, results):
        if err:
            log_warning(f"keeping {len(job.keepalive)} alert(s) alive: {scrub(err, [t.url])}")


# A hook's process ends right after the hook: a delivery thread would die with it, possibly in the middle of a
# request its receiver already has (which the next flush would then send again). Hooks therefore only spool
# (`deliver(..., defer=<the run's Handoff>)`) and gpuguard.notify.handoff delivers in a process of its own that
# outlives the hook.


def _work(job: Job, done: dict[int, bool]) -> None:
    """Worker thread: its own connection (the caller may have returned already); progress recorded per row."""
    import sqlite3  # only when there is something to deliver: nothing configured imports no SQLite

    conn = sqlite3.connect(job.path, timeout=5.0, isolation_level=None)
    try:
        for row in job.rows:
            ok = _deliver_row(conn, row, job)
            if ok is not None:
                done[row.id] = ok
        _keepalive(conn, job)
    except Exception as e:  # noqa: BLE001 - a daemon thread's exception would only reach stderr
        log_warning(f"delivery: {type(e).__name__}: {e}")
    finally:
        conn.close()


def deliver(job: Job, budget_s: float, defer: Optional[Handoff] = None) -> dict[int, bool]:
    """Run `job` in a worker thread for at most `budget_s`; {row id: delivered} of what finished by then. The rest
    goes on in the worker thread while this process lives (recorded in the spool as it goes). `defer` (a hook's
    run): nothing is sent from this process; the run's Handoff says a hand-off process must deliver."""
    done: dict[int, bool] = {}
    if not job.rows and not job.keepalive:
        return done
    if defer is not None:
        defer.wanted = True
        return done
    t = threading.Thread(target=_work, args=(job, done), name="gpuguard-notify", daemon=True)
    t.start()
    t.join(max(0.0, budget_s))
    return dict(done)


def deliver_direct(ncfg: NotifyConfig, event: Event, title: str, body: str, key: str, now: float, ttl: float,
                   budget_s: float) -> str:
    """No usable state: send straight away to every target, without gates, spool or keep-alive. Better a
    duplicate page than a silenced drain."""
    state = "resolved" if event.resolved else "firing"
    result: dict[str, bool] = {}

    def run() -> None:
        oks = []
        for t in targets_of(ncfg).values():
            if t.kind == "apprise":
                oks.append(send_apprise(t.url, title, body, event.severity, key, state, ncfg.timeout_s)[0])
                continue
            try:
                post_alerts(t.url, amstate.direct_payload(event, ncfg, now, ttl), ncfg.timeout_s)
                oks.append(True)
            except PostError:
                oks.append(False)
        result["ok"] = all(oks)

    t = threading.Thread(target=run, name="gpuguard-notify-direct", daemon=True)
    t.start()
    t.join(max(0.0, budget_s))
    return "sent" if result.get("ok") else "failed"
