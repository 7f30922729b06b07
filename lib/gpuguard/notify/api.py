"""emit / flush / spool_status: what the hooks, the watch daemon, the monitor and `gpuguard status` call.
Each takes the time from its caller (`now`); none raises; emit and flush never take longer than their budget
(plus the state's lock timeout)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Optional

from gpuguard.model import Handoff
from gpuguard.notify import amstate, delivery, gate
from gpuguard.notify.budget import state_timeout_s
from gpuguard.notify.alertmanager import ttl_s
from gpuguard.config.sections.notify import NotifyConfig
from gpuguard.notify.event import Event, dedupe_key, wanted
from gpuguard.notify.render import render
from gpuguard.notify.state import (DeliveryLog, connect_hooks, connect_user, ensure_trusted_state, local_node,
                                   log_warning, state_path)
from gpuguard.util.sqltx import rollback_if_active

if TYPE_CHECKING:
    from gpuguard.config.schema import Config


def enabled(cfg: "Config") -> Optional[NotifyConfig]:
    """The notify section when anything is configured to receive (apprise URLs or Alertmanagers), else None."""
    return cfg.notify if cfg.notify.receivers else None


def _open(cfg: "Config", ncfg: NotifyConfig, node: Optional[str], user_state: Optional[str],
          timeout: float) -> tuple[Optional[Any], str, Optional[str]]:
    """(connection or None, path, why the hooks' state cannot be used)."""
    if user_state is not None:
        return connect_user(user_state, timeout), user_state, None
    path = state_path(cfg, local_node(cfg, node))
    why = ensure_trusted_state(path)
    if why:
        return None, path, why
    return connect_hooks(path, timeout), path, None


def _decide(conn: Any, ncfg: NotifyConfig, event: Event, key: str, now: float,
            targets: dict[str, delivery.Target]) -> tuple[str, list[str], Optional[gate.Decision]]:
    """In one transaction: the gates for the apprise URLs, the Alertmanager alert's state. Returns (verdict,
    targets to deliver to now, the gate's decision)."""
    apprise_ids = [i for i, t in targets.items() if t.kind == "apprise"] if wanted(ncfg, event) else []
    am_ids = [i for i, t in targets.items() if t.kind == "alertmanager"] if wanted(ncfg, event, True) else []
    conn.execute("BEGIN IMMEDIATE")
    try:
        d = gate.gate(conn, ncfg, event, key, now) if apprise_ids else None
        am_now = amstate.record(conn, event, key, ncfg, now) if am_ids else False
        conn.execute("COMMIT")
    except BaseException:
        rollback_if_active(conn)
        raise
    send = (apprise_ids if d is not None and d.verdict == "send" else []) + (am_ids if am_now else [])
    verdict = "send" if send else (d.verdict if d is not None and d.verdict == "held" else "suppressed")
    return verdict, send, d


def delivery_log(cfg: "Config") -> DeliveryLog:
    return DeliveryLog(cfg.logging.file, cfg.logging.level)


def emit(cfg: "Config", event: Event, budget_s: float = 2.0, state_path: Optional[str] = None,
         now: Optional[float] = None, defer: Optional[Handoff] = None) -> str:
    """Send `event` (or fold it into its episode / a digest / the spool). Returns "sent" | "suppressed" |
    "spooled" | "disabled" | "failed" (the state could not be used and direct delivery failed too).
    `now`: the caller's clock (default: the event's own time). `state_path`: a caller with its own state (the
    monitor, as the job's user; see user_state_path). A state that cannot be used (untrusted, full disk,
    read-only, locked) never silences a message: it is then delivered directly, without de-duplication.
    `defer`: a hook's run (its process ends right after it): the message is spooled, the run's Handoff says so, and a
    process of its own delivers it once the hook has exited (gpuguard.notify.handoff), so that nothing is cut off
    mid-request and sent again."""
    start = time.monotonic()
    now = event.ts if now is None else now
    ncfg = enabled(cfg)
    if ncfg is None or not (wanted(ncfg, event) or (ncfg.alertmanager_urls and wanted(ncfg, event, True))):
        return "disabled"
    row_id: Optional[int] = None
    prefix = ncfg.title_prefix
    key = dedupe_key(event, prefix)
    ttl = ttl_s(cfg)

    def direct(why: str) -> str:
        log_warning(f"not using notification state ({why}); delivering {event.kind} {event.node} directly")
        title, body = render(event, prefix)
        left = max(0.0, budget_s - (time.monotonic() - start))
        return delivery.deliver_direct(ncfg, event, title, body, key, now, ttl, left)

    try:
        targets = delivery.targets_of(ncfg)
        conn, path, why = _open(cfg, ncfg, event.node, state_path, state_timeout_s(budget_s))
        if conn is None:
            return direct(str(why))
        try:
            verdict, send, d = _decide(conn, ncfg, event, key, now, targets)
            title, body = render(event, prefix, *((d.repeats, d.since, d.opened) if d else ()))
            if d is not None and d.verdict == "held":  # over the rate limit: kept, leaves in the next digest
                held = [i for i, t in targets.items() if t.kind == "apprise"]
                delivery.spool(conn, event, title, body, held, "held", now, key=key)
            if not send:
                return "suppressed"
            row_id = delivery.spool(conn, event, title, body, send, "pending", now, key=key)
        finally:
            conn.close()
        row = delivery.Row(row_id, title, body, event.severity, send, key, "resolved" if event.resolved else "firing")
        job = delivery.Job(path, [row], targets, now, ncfg.timeout_s, ttl, [], log=delivery_log(cfg))
        done = delivery.deliver(job, budget_s - (time.monotonic() - start), defer=defer)
        return "sent" if done.get(row_id) else "spooled"
    except Exception as e:  # noqa: BLE001 - notifying must never break a prolog
        log_warning(f"emit {event.kind} {event.node}: {type(e).__name__}: {e}")
        if row_id is not None:
            return "spooled"
        try:  # the state failed us before the message was kept: it goes out directly
            return direct(f"{type(e).__name__}: {e}")
        except Exception as e2:  # noqa: BLE001
            log_warning(f"emit {event.kind} {event.node}: direct delivery: {type(e2).__name__}: {e2}")
            return "failed"


def _prepare_flush(conn: Any, ncfg: NotifyConfig, targets: dict[str, delivery.Target],
                   now: float) -> tuple[list[delivery.Row], dict[str, Optional[float]]]:
    conn.execute("UPDATE notify_spool SET status='expired' WHERE status IN ('pending','held') AND created < ?",
                 (now - ncfg.spool_max_age_h * 3600,))
    apprise_ids = [i for i, t in targets.items() if t.kind == "apprise"]
    conn.execute("BEGIN IMMEDIATE")
    try:
        digest = gate.held_digest(conn, ncfg, now) if apprise_ids else None
        if digest:
            title, body, severity, state, ids = digest
            delivery.spool(conn, None, title, body, apprise_ids, "pending", now, severity,
                           key=gate.digest_key(ncfg, now), state=state)
            conn.execute(f"UPDATE notify_spool SET status='digested' WHERE id IN ({','.join('?' * len(ids))})", ids)
        keepalive: dict[str, Optional[float]] = {}
        if ncfg.alertmanager_urls:
            amstate.forget_old(conn, now, ncfg.spool_max_age_h * 3600)
            keepalive = amstate.take_keepalives(conn, now, ncfg.alertmanager_resend_s)
        conn.execute("COMMIT")
    except BaseException:
        rollback_if_active(conn)
        raise
    return delivery.due_rows(conn, now), keepalive


def flush(cfg: "Config", budget_s: float = 5.0, state_path: Optional[str] = None,
          now: Optional[float] = None, node: Optional[str] = None, defer: Optional[Handoff] = None) -> int:
    """Retry spooled messages, send the digest of rate-limited ones, keep firing Alertmanager alerts alive.
    Returns how many spooled messages were delivered within `budget_s`. Never raises. `node`: whose hooks' state
    (default: this node's). `defer`: a hook's run, whose process ends right after it: deliver nothing from here, leave
    it to the hand-off process (gpuguard.notify.handoff) and say so in the run's Handoff."""
    try:
        ncfg = enabled(cfg)
        if ncfg is None:
            return 0
        start = time.monotonic()
        now = time.time() if now is None else now
        conn, path, why = _open(cfg, ncfg, node, state_path, state_timeout_s(budget_s))
        if conn is None:
            log_warning(f"not using notification state ({why}); nothing flushed")
            return 0
        targets = delivery.targets_of(ncfg)
        try:
            rows, keepalive = _prepare_flush(conn, ncfg, targets, now)
        finally:
            conn.close()
        job = delivery.Job(path, rows, targets, now, ncfg.timeout_s, ttl_s(cfg), list(keepalive), keepalive,
                           log=delivery_log(cfg))
        done = delivery.deliver(job, budget_s - (time.monotonic() - start), defer=defer)
        return sum(1 for ok in done.values() if ok)
    except Exception as e:  # noqa: BLE001
        log_warning(f"flush: {type(e).__name__}: {e}")
        return 0


def spool_status(cfg: "Config", node: Optional[str] = None) -> dict[str, int]:
    """Counts of spooled messages by status (for `gpuguard status`). Read-only."""
    if enabled(cfg) is None:
        return {}
    path = state_path(cfg, node or local_node(cfg))
    if not os.path.exists(path):
        return {}
    conn = connect_hooks(path, timeout_s=1.0)
    try:
        return {s: n for s, n in conn.execute("SELECT status, COUNT(*) FROM notify_spool GROUP BY status")}
    finally:
        conn.close()
