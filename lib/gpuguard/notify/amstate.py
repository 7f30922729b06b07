"""The alerts gpuguard has posted to Alertmanager, kept in the notification state (`notify_am_alerts`), and what
to post for them: the current state of an incident, never a replay of old events (a late retry of a firing
alert whose resolution is already known posts the resolution)."""

from __future__ import annotations

import json
from typing import Any, Optional

from gpuguard.config.sections.notify import NotifyConfig
from gpuguard.notify.alertmanager import alert_annotations, alert_labels, postable
from gpuguard.notify.event import Event


def _row(conn: Any, key: str) -> Optional[dict[str, Any]]:
    r = conn.execute("SELECT labels, annotations, starts_at, ends_at, last_posted, superseded FROM notify_am_alerts "
                     "WHERE key=?", (key,)).fetchone()
    if r is None:
        return None
    return {"labels": json.loads(r[0]), "annotations": json.loads(r[1]), "starts_at": r[2], "ends_at": r[3],
            "last_posted": r[4], "superseded": json.loads(r[5]) if r[5] else None}


def _put(conn: Any, key: str, labels: dict[str, str], annotations: dict[str, str], starts: float,
         ends: Optional[float], last_posted: Optional[float], superseded: Optional[dict[str, Any]]) -> None:
    conn.execute("INSERT OR REPLACE INTO notify_am_alerts(key, labels, annotations, starts_at, ends_at, last_posted, "
                 "superseded) VALUES (?,?,?,?,?,?,?)",
                 (key, json.dumps(labels, sort_keys=True), json.dumps(annotations, sort_keys=True), starts, ends,
                  last_posted, json.dumps(superseded) if superseded else None))


# Nothing ever resolves these (a failed prolog, a crash, a requeue, an unknown Xid): their alert ends by itself
# dedup_window_s after the last time it happened, as their episode does, and is not kept alive.
SELF_ENDING = {"prolog_failure", "internal_error", "requeue", "unknown_xid", "storm", "mismatch", "gave_up", "network"}


def _is_open(row: Optional[dict[str, Any]], now: float) -> bool:
    return row is not None and (row["ends_at"] is None or row["ends_at"] > now)


def record(conn: Any, event: Event, key: str, ncfg: NotifyConfig, now: float) -> bool:
    """Fold `event` into the alert of its incident; True when Alertmanager must hear about it now (a new alert,
    a resolution, a drain or FLAPPING, or a repeat whose last post is older than alertmanager_resend_s; other
    repeats are carried by the next keep-alive). The caller holds a transaction."""
    row = _row(conn, key)
    if event.family in SELF_ENDING and not event.resolved:
        return _record_self_ending(conn, event, key, ncfg, now, row)
    notes = alert_annotations(event, ncfg)
    if event.resolved:
        if row is None:  # not posted from here (another node of the job fired it): resolve what it would be
            _put(conn, key, alert_labels(event, ncfg), notes, now, now, None, None)
            return True
        if row["ends_at"] is not None:
            return False  # already resolved
        kept = dict(row["annotations"], resolution=notes.get("description", ""))
        _put(conn, key, row["labels"], kept, row["starts_at"], now, row["last_posted"], row["superseded"])
        return True
    labels = alert_labels(event, ncfg)
    if row is None or row["ends_at"] is not None:  # a new alert
        _put(conn, key, labels, notes, now, None, None, None)
        return True
    if event.kind == "drain" and labels != row["labels"]:
        # drained again for another check while the old drain's alert was open (its end went unnoticed):
        # that alert ends now, the new one starts
        old = {"labels": row["labels"], "annotations": row["annotations"], "starts_at": row["starts_at"],
               "ends_at": now}
        _put(conn, key, labels, notes, now, None, None, old)
        return True
    if event.kind == "flapping":  # the same drain, escalated: its labels stay, what it says changes
        notes = dict(notes, summary=f"{notes['summary']} (FLAPPING)")
    _put(conn, key, row["labels"], notes, row["starts_at"], None, row["last_posted"], row["superseded"])
    stale = row["last_posted"] is None or now - row["last_posted"] >= ncfg.alertmanager_resend_s
    return event.kind in ("drain", "flapping") or stale


def _record_self_ending(conn: Any, event: Event, key: str, ncfg: NotifyConfig, now: float,
                        row: Optional[dict[str, Any]]) -> bool:
    ends = now + (ncfg.dedup_window_s or 3600.0)
    if not _is_open(row, now):
        _put(conn, key, alert_labels(event, ncfg), alert_annotations(event, ncfg), now, ends, None, None)
        return True
    assert row is not None
    _put(conn, key, row["labels"], alert_annotations(event, ncfg), row["starts_at"], ends, row["last_posted"], None)
    return row["last_posted"] is None or now - row["last_posted"] >= ncfg.alertmanager_resend_s


def payload(conn: Any, keys: list[str], now: float, ttl: float) -> list[dict[str, Any]]:
    """What to post for these incidents now: each one's current state, plus an alert it superseded."""
    out = []
    for key in dict.fromkeys(keys):
        row = _row(conn, key)
        if row is None:
            continue
        out.append(postable(row["labels"], row["annotations"], row["starts_at"], row["ends_at"], now, ttl))
        old = row["superseded"]
        if old:
            out.append(postable(old["labels"], old["annotations"], old["starts_at"], old["ends_at"], now, ttl))
    return out


def take_keepalives(conn: Any, now: float, resend_s: float) -> dict[str, Optional[float]]:
    """The firing alerts whose last complete post is older than `resend_s` (or that never got one), taken for one
    keep-alive post: {key: its last post before}. Taken means their last post reads `now` already, so that a flush
    running beside this one does not post them too; `return_keepalives` gives back what could not be posted. An
    alert whose own spooled message is still pending is left to that message. The caller holds a transaction."""
    due = {k: last for k, last in conn.execute(
        "SELECT key, last_posted FROM notify_am_alerts WHERE ends_at IS NULL "
        "AND (last_posted IS NULL OR last_posted <= ?) AND key NOT IN "
        "(SELECT dedup_key FROM notify_spool WHERE status='pending' AND dedup_key IS NOT NULL) "
        "ORDER BY starts_at LIMIT 500", (now - resend_s,))}
    mark_posted(conn, list(due), now)
    return due


def return_keepalives(conn: Any, keys: list[str], taken: dict[str, Optional[float]], now: float) -> None:
    """A keep-alive post failed: the alerts are due again (unless something posted them since)."""
    conn.executemany("UPDATE notify_am_alerts SET last_posted=? WHERE key=? AND last_posted=?",
                     [(taken.get(k), k, now) for k in keys])


def mark_posted(conn: Any, keys: list[str], now: float) -> None:
    conn.executemany("UPDATE notify_am_alerts SET last_posted=? WHERE key=?", [(now, k) for k in keys])


def forget_old(conn: Any, now: float, keep_s: float) -> None:
    """Resolved alerts are kept `keep_s` (a late retry must still find their end), then dropped."""
    conn.execute("DELETE FROM notify_am_alerts WHERE ends_at IS NOT NULL AND ends_at < ?", (now - keep_s,))


def direct_payload(event: Event, ncfg: NotifyConfig, now: float, ttl: float) -> list[dict[str, Any]]:
    """No usable state: the alert as this event alone describes it."""
    ends = now if event.resolved else None
    return [postable(alert_labels(event, ncfg), alert_annotations(event, ncfg), event.ts, ends, now, ttl)]
