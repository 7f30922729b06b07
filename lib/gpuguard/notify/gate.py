"""The gates a message to the apprise receivers passes before it is sent (Alertmanager does its own grouping and
de-duplication, and gets every state change):

1. **episodes**: one message per incident until it is resolved; repeats are counted, not sent; an episode that
   nothing repeated or resolved for `dedup_window_s` is over. A drain or a FLAPPING pin is always sent;
2. **rate limit**: at most `rate_limit` messages per `rate_window_s` from one state file; the rest are held and
   leave as one digest when there is room again (a resolution whose alert went out is never held).

Everything here runs inside one SQLite transaction of the caller's connection; the time is the caller's `now`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from gpuguard.config.sections.notify import NotifyConfig
from gpuguard.notify.event import ALWAYS_SEND, Event, key_part
from gpuguard.notify.render import render_digest, worst_severity


@dataclass
class Decision:
    verdict: str  # send | suppressed | held
    repeats: int = 0
    since: Optional[float] = None
    opened: Optional[float] = None


def _upsert_key(conn: Any, key: str, **cols: Any) -> None:
    names = ["key"] + list(cols)
    conn.execute(f"INSERT INTO notify_keys({','.join(names)}) VALUES ({','.join('?' * len(names))}) "
                 f"ON CONFLICT(key) DO UPDATE SET {', '.join(f'{c}=excluded.{c}' for c in cols)}",
                 [key] + list(cols.values()))


def rate_full(conn: Any, ncfg: NotifyConfig, now: float) -> bool:
    conn.execute("DELETE FROM notify_sent WHERE ts < ?", (now - ncfg.rate_window_s,))
    return bool(conn.execute("SELECT COUNT(*) FROM notify_sent").fetchone()[0] >= ncfg.rate_limit)


def _episode(conn: Any, ncfg: NotifyConfig, key: str, now: float) -> tuple[Any, ...]:
    row = conn.execute("SELECT last_sent, suppressed, first_suppressed, opened, last_seen, is_open, announced "
                       "FROM notify_keys WHERE key=?", (key,)).fetchone()
    last_sent, suppressed, first_suppressed, opened, last_seen, is_open, announced = \
        row if row else (None, 0, None, None, None, 0, 0)
    if is_open is None:  # a row from before episodes: open while its last message is within the window
        is_open, last_seen = int(last_sent is not None), last_seen or last_sent
    open_now = bool(is_open) and last_seen is not None and now - last_seen < ncfg.dedup_window_s
    return suppressed, first_suppressed, opened, is_open, announced, open_now


def _resolution(conn: Any, ncfg: NotifyConfig, key: str, now: float) -> Decision:
    suppressed, first_suppressed, opened, is_open, announced, open_now = _episode(conn, ncfg, key, now)
    _upsert_key(conn, key, is_open=0, last_seen=now, suppressed=0, first_suppressed=None)
    if not ncfg.send_resolved:
        return Decision("suppressed")
    decision = Decision("send", suppressed if open_now else 0, first_suppressed if open_now else None,
                        opened if (open_now or is_open) else None)
    if not (is_open and announced) and rate_full(conn, ncfg, now):  # its alert was not sent on its own
        return Decision("held")
    conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
    return decision


def _alert(conn: Any, ncfg: NotifyConfig, event: Event, key: str, now: float) -> Decision:
    suppressed, first_suppressed, opened, _, _, open_now = _episode(conn, ncfg, key, now)
    if open_now and event.kind not in ALWAYS_SEND:
        conn.execute("UPDATE notify_keys SET suppressed=suppressed+1, "
                     "first_suppressed=COALESCE(first_suppressed,?), last_seen=? WHERE key=?", (now, now, key))
        return Decision("suppressed")
    # a new episode (or a transition Slurm confirmed); an episode that expired hands on its count
    carried = (suppressed, first_suppressed) if suppressed else (0, None)
    start = opened if open_now and opened and event.kind != "drain" else now  # FLAPPING escalates the drain
    if rate_full(conn, ncfg, now):
        _upsert_key(conn, key, is_open=1, opened=start, last_seen=now, announced=0, suppressed=0,
                    first_suppressed=None)
        return Decision("held")
    conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
    _upsert_key(conn, key, is_open=1, opened=start, last_seen=now, last_sent=now, announced=1, suppressed=0,
                first_suppressed=None)
    return Decision("send", carried[0], carried[1], start)


def gate(conn: Any, ncfg: NotifyConfig, event: Event, key: str, now: float) -> Decision:
    """Episodes and the rate limit for one event. The caller holds a transaction."""
    return _resolution(conn, ncfg, key, now) if event.resolved else _alert(conn, ncfg, event, key, now)


def held_digest(conn: Any, ncfg: NotifyConfig, now: float) -> Optional[tuple[str, str, str, str, list[int]]]:
    """When messages are held and the rate limit has room: (title, body, severity, state, held row ids) of the
    one digest that replaces them, counted against the limit. The caller holds a transaction, spools the
    digest and marks the rows digested."""
    held = conn.execute("SELECT id, event FROM notify_spool WHERE status='held' ORDER BY id").fetchall()
    if not held or rate_full(conn, ncfg, now):
        return None
    events = [json.loads(e) for _, e in held if e]
    title, body = render_digest(events, ncfg.title_prefix,
                                f"{len(events)} notifications were held back by the rate limit "
                                f"({ncfg.rate_limit} per {ncfg.rate_window_s:g} s):")
    conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
    state = "resolved" if events and all(e.get("state") == "resolved" for e in events) else "firing"
    return title, body, worst_severity(events), state, [i for i, _ in held]


def digest_key(ncfg: NotifyConfig, now: float) -> str:
    return f"{key_part(ncfg.title_prefix)}/digest/held/{int(now)}"
