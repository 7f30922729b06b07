"""Notifications through apprise (Slack, webhooks, email, SNS, PagerDuty, ... by URL in `notify.urls`).

    emit(cfg, Event(kind="drain", node="node2", message=..., check_id="gpu.xid", action="reboot", ...))

goes through three gates before anything is sent, so that one bad rack does not page 500 times:

1. **de-duplication** per node + check + kind: a repeat within `dedup_window_s` is counted, not sent; the next
   message that does go out says how many were folded into it;
2. **fleet-wide grouping** (when `shared_dir` names a directory on a shared filesystem): each node drops a marker
   file per (kind, check, time window); once more than `group_threshold` nodes have one, later nodes stay quiet
   and one digest naming every node (`node[001-037]`) goes out when the window closes, sent by whichever node's
   `flush` claims it first (O_EXCL file creation: atomic on local and NFSv3+ filesystems);
3. **rate limit**: at most `rate_limit` messages per `rate_window_s` from one state file; the rest are held and
   leave as one digest when there is room again.

What cannot be delivered (network down, a webhook timing out) stays in a spool table in the history store
(`notify_spool`) and is retried by `flush()`, which the health check, the watch daemon and the monitor call
periodically. Delivery runs in a worker thread: `emit` never blocks longer than its budget and never raises.
With no URL configured, `emit` returns "disabled" without importing apprise or opening anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from gpuguard.hostlist import compress_hostlist

if TYPE_CHECKING:
    from gpuguard.config import Config

KINDS = ("drain", "undrain", "prolog_failure", "straggler", "hang", "requeue", "internal_error", "flapping",
         "resource")  # resource: a monitor threshold (CPU, memory, disk, GPU temperature/power/ECC) during a job
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}

# What a human should do next, when the caller did not say (every message names one).
DEFAULT_ACTIONS = {
    "drain": "fix what the reason names (reset / reboot / replace), then let the health check undrain it "
             "(or `gpuguard undrain NODE`)",
    "undrain": "none: the check that drained the node passes again",
    "prolog_failure": "none for the job (Slurm requeues it on other nodes); inspect the node: "
                      "`gpuguard history --node NODE`",
    "straggler": "check the GPU's clocks, cooling and power (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE`); "
                 "drain the node if it persists",
    "hang": "look at the stack dumps, then cancel or requeue the job (`scontrol requeue JOBID`)",
    "requeue": "none: the job was requeued; check it resumes from its last checkpoint",
    "internal_error": "a gpuguard bug or an unreadable config: see the log (nodes were not drained: fail-open)",
    "flapping": "the node keeps failing and recovering: inspect the hardware before undraining it by hand",
    "resource": "look at what the job is doing on the node (memory, disk, data loader workers); the job may fail",
}
_TITLES = {"drain": "DRAINED", "undrain": "undrained", "prolog_failure": "prolog failed", "straggler": "straggler",
           "hang": "job hang", "requeue": "job requeued", "internal_error": "internal error",
           "flapping": "flapping node", "resource": "resource alarm"}


@dataclass
class Event:
    kind: str  # drain|undrain|prolog_failure|straggler|hang|requeue|internal_error|flapping
    node: str
    message: str
    severity: str = "warning"  # critical|warning|info
    check_id: Optional[str] = None
    action: Optional[str] = None
    reason: Optional[str] = None
    job_id: Optional[str] = None
    evidence: dict = field(default_factory=dict)  # type: ignore[type-arg]
    ts: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        return f"{self.node}|{self.check_id or '-'}|{self.kind}"



# --------------------------------------------------------------------------- pure helpers


def _evidence_text(evidence: dict, limit: int = 1200) -> str:  # type: ignore[type-arg]
    text = "; ".join(f"{k}={json.dumps(v, default=str, separators=(',', ':'))}" for k, v in evidence.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render(event: Event, prefix: str = "gpuguard", repeats: int = 0, since: Optional[float] = None) -> tuple[str, str]:
    """(title, body) naming the node, the check, the evidence and the suggested action. Pure."""
    title = f"{prefix}: {_TITLES.get(event.kind, event.kind)} {event.node}" + \
        (f" {event.check_id}" if event.check_id else "")
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(event.ts))
    lines = [
        f"node:     {event.node}",
        f"event:    {event.kind} ({event.severity})",
        f"check:    {event.check_id or '-'}",
        f"what:     {event.message}",
    ]
    if event.reason:
        lines.append(f"reason:   {event.reason}")
    if event.job_id:
        lines.append(f"job:      {event.job_id}")
    lines.append(f"evidence: {_evidence_text(event.evidence) if event.evidence else '-'}")
    lines.append(f"action:   {event.action or DEFAULT_ACTIONS.get(event.kind, 'see the gpuguard log')}")
    lines.append(f"when:     {when}")
    if repeats:
        first = time.strftime("%H:%M:%SZ", time.gmtime(since)) if since else "earlier"
        lines.append(f"(also happened {repeats} more time(s) since {first}; those were not sent separately)")
    return title, "\n".join(lines)


def render_digest(events: list[dict[str, Any]], prefix: str, why: str) -> tuple[str, str]:
    """One message for many events (held by the rate limit, or a fleet-wide group). Pure."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in events:
        by.setdefault((e["kind"], e.get("check_id") or "-"), []).append(e)
    nodes = sorted({e["node"] for e in events})
    title = f"{prefix}: {len(events)} events on {len(nodes)} node(s): {compress_hostlist(nodes)}"
    lines = [f"{why}", ""]
    for (kind, check), evs in sorted(by.items()):
        worst = max(evs, key=lambda e: SEVERITY_RANK.get(e.get("severity", "warning"), 1))
        lines.append(f"{kind} {check} x{len(evs)} on {compress_hostlist(e['node'] for e in evs)} "
                     f"({worst.get('severity', 'warning')})")
        lines.append(f"  e.g. {worst['node']}: {worst['message']}")
        if worst.get("reason"):
            lines.append(f"  reason: {worst['reason']}")
        lines.append(f"  action: {worst.get('action') or DEFAULT_ACTIONS.get(kind, 'see the gpuguard log')}")
    return title, "\n".join(lines)


def _url_id(url: str) -> str:
    """Spool rows name targets by hash: URLs carry tokens and passwords, the spool file should not."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- state (SQLite, in the history store)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS notify_keys (key TEXT PRIMARY KEY, last_sent REAL, suppressed INTEGER NOT NULL DEFAULT 0,
    first_suppressed REAL);
CREATE TABLE IF NOT EXISTS notify_sent (ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS notify_spool (
    id INTEGER PRIMARY KEY, created REAL NOT NULL, kind TEXT, node TEXT, check_id TEXT, severity TEXT,
    title TEXT NOT NULL, body TEXT NOT NULL,
    targets TEXT NOT NULL,          -- JSON list of url ids still to deliver to
    status TEXT NOT NULL,           -- pending | held | digested | sent | expired
    attempts INTEGER NOT NULL DEFAULT 0, next_try REAL NOT NULL DEFAULT 0, last_error TEXT,
    event TEXT                      -- the Event as JSON (digests are built from these)
);
CREATE INDEX IF NOT EXISTS notify_spool_status ON notify_spool(status, next_try);
"""


def local_node(cfg: "Config", fallback: Optional[str] = None) -> str:
    return (cfg.sections["node"].get("name") or os.environ.get("SLURMD_NODENAME") or fallback
            or socket.gethostname().split(".")[0])


def _state_path(cfg: "Config", node: str) -> str:
    n = cfg.sections["notify"]
    return (n["state_path"] or cfg.sections["store"]["path"]).replace("{node}", node)


def _connect(path: str, timeout_s: float) -> Any:
    from gpuguard.store import Store

    store = Store(path, timeout_s=timeout_s)  # WAL, busy timeout, a corrupt file is moved aside
    store.conn.executescript(_SCHEMA)
    return store.conn


def _log(msg: str) -> None:
    """Notification trouble must be visible somewhere even when it cannot be notified."""
    try:
        import syslog

        syslog.syslog(syslog.LOG_WARNING, f"gpuguard notify: {msg}")
    except Exception:  # noqa: BLE001
        pass


# --------------------------------------------------------------------------- gates


def _gate_group(shared_dir: str, event: Event, now: float, window_s: float, threshold: int) -> bool:
    """True when this event joins a fleet-wide group that is already past its threshold (stay quiet)."""
    bucket = int(now // window_s)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{event.kind}__{event.check_id or '-'}__{bucket}")
    gdir = os.path.join(shared_dir, "groups", safe)
    os.makedirs(gdir, exist_ok=True)
    marker = os.path.join(gdir, re.sub(r"[^A-Za-z0-9_.-]", "_", event.node) + ".json")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(event), f, default=str)
    except FileExistsError:
        pass  # this node is already counted in this window (de-dup keeps it quiet anyway)
    members = sorted(n for n in os.listdir(gdir) if n.endswith(".json"))
    rank = members.index(os.path.basename(marker)) if os.path.basename(marker) in members else len(members)
    # the first `threshold` nodes (by arrival) page individually; order by mtime, ties by name
    by_time = sorted(members, key=lambda n: (os.stat(os.path.join(gdir, n)).st_mtime_ns, n))
    rank = by_time.index(os.path.basename(marker)) if os.path.basename(marker) in by_time else rank
    return rank >= threshold


def _gate(conn: Any, ncfg: dict[str, Any], event: Event, now: float) -> tuple[str, int, Optional[float]]:
    """-> ("send", repeats, since) | ("suppressed", 0, None) | ("held", 0, None). One transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT last_sent, suppressed, first_suppressed FROM notify_keys WHERE key=?",
                           (event.key,)).fetchone()
        if row and row[0] is not None and now - row[0] < ncfg["dedup_window_s"]:
            conn.execute("UPDATE notify_keys SET suppressed=suppressed+1, first_suppressed=COALESCE(first_suppressed,?)"
                         " WHERE key=?", (now, event.key))
            conn.execute("COMMIT")
            return "suppressed", 0, None
        if ncfg["shared_dir"]:
            try:
                if _gate_group(ncfg["shared_dir"], event, now, ncfg["group_window_s"], ncfg["group_threshold"]):
                    conn.execute("INSERT INTO notify_keys(key,last_sent,suppressed) VALUES (?,?,0) ON CONFLICT(key)"
                                 " DO UPDATE SET last_sent=excluded.last_sent, suppressed=0, first_suppressed=NULL",
                                 (event.key, now))
                    conn.execute("COMMIT")
                    return "suppressed", 0, None
            except OSError as e:  # a shared filesystem that is down must not stop local paging
                _log(f"shared_dir {ncfg['shared_dir']} unusable ({e}); not grouping")
        conn.execute("DELETE FROM notify_sent WHERE ts < ?", (now - ncfg["rate_window_s"],))
        sent = conn.execute("SELECT COUNT(*) FROM notify_sent").fetchone()[0]
        if sent >= ncfg["rate_limit"]:
            conn.execute("COMMIT")
            return "held", 0, None
        conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
        repeats, since = (row[1], row[2]) if row else (0, None)
        conn.execute("INSERT INTO notify_keys(key,last_sent,suppressed) VALUES (?,?,0) ON CONFLICT(key) DO UPDATE "
                     "SET last_sent=excluded.last_sent, suppressed=0, first_suppressed=NULL", (event.key, now))
        conn.execute("COMMIT")
        return "send", repeats, since
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _spool(conn: Any, event: Optional[Event], title: str, body: str, targets: list[str], status: str,
           now: float, severity: Optional[str] = None) -> int:
    cur = conn.execute(
        "INSERT INTO notify_spool(created,kind,node,check_id,severity,title,body,targets,status,next_try,event) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (now, event.kind if event else "digest", event.node if event else None, event.check_id if event else None,
         severity or (event.severity if event else "warning"), title, body, json.dumps(targets), status, now,
         json.dumps(asdict(event), default=str) if event else None))
    return int(cur.lastrowid or 0)


# --------------------------------------------------------------------------- delivery


def _notify_type(apprise: Any, severity: str) -> Any:
    return {"critical": apprise.NotifyType.FAILURE, "warning": apprise.NotifyType.WARNING}.get(
        severity, apprise.NotifyType.INFO)


def _deliver_rows(path: str, rows: list[tuple[int, str, str, str, list[str]]], urls: dict[str, str],
                  done: dict[int, bool]) -> None:
    """Worker thread: deliver each spooled row to its remaining targets; record progress in the spool as it goes
    (its own connection: the caller may have returned already)."""
    import sqlite3

    try:
        import apprise
    except ImportError as e:
        _log(f"apprise is not installed ({e}): pip install apprise; messages stay spooled")
        return
    conn = sqlite3.connect(path, timeout=5.0, isolation_level=None)
    try:
        for row_id, title, body, severity, targets in rows:
            left, errors = [], []
            for tid in targets:
                url = urls.get(tid)
                if url is None:
                    continue  # that URL was removed from the config: nobody to deliver to
                client = apprise.Apprise()
                if not client.add(url):
                    errors.append(f"invalid URL #{tid}")  # permanent: retrying cannot help
                    continue
                try:
                    ok = bool(client.notify(title=title, body=body, notify_type=_notify_type(apprise, severity),
                                             body_format=apprise.NotifyFormat.TEXT))
                except Exception as e:  # noqa: BLE001 - a plugin bug must not lose the message
                    ok, errors = False, errors + [f"{type(e).__name__}: {e}"]
                if not ok:
                    left.append(tid)
                    errors.append(f"delivery to #{tid} failed")
            if left:
                conn.execute("UPDATE notify_spool SET targets=?, attempts=attempts+1, last_error=?, "
                             "next_try=? + MIN(3600, 30 * (1 << MIN(attempts, 7))) WHERE id=?",
                             (json.dumps(left), "; ".join(errors)[:500], time.time(), row_id))
                done[row_id] = False
            else:
                conn.execute("UPDATE notify_spool SET status='sent', targets='[]', attempts=attempts+1, "
                             "last_error=? WHERE id=?", ("; ".join(errors)[:500] or None, row_id))
                done[row_id] = True
    finally:
        conn.close()


def _deliver(path: str, rows: list[tuple[int, str, str, str, list[str]]], urls: dict[str, str],
             budget_s: float) -> dict[int, bool]:
    done: dict[int, bool] = {}
    if not rows:
        return done
    t = threading.Thread(target=_deliver_rows, args=(path, rows, urls, done), name="gpuguard-notify", daemon=True)
    t.start()
    t.join(max(0.0, budget_s))
    return dict(done)


def _enabled(cfg: "Config") -> Optional[dict[str, Any]]:
    ncfg = cfg.sections.get("notify")
    return ncfg if ncfg and ncfg.get("urls") else None


# --------------------------------------------------------------------------- the API


def emit(cfg: "Config", event: Event, budget_s: float = 2.0) -> str:
    """Send `event` (or suppress / spool it). Returns "sent" | "suppressed" | "spooled" | "disabled".
    Never raises, never takes longer than `budget_s`."""
    row_id: Optional[int] = None
    try:
        ncfg = _enabled(cfg)
        if ncfg is None:
            return "disabled"
        if event.kind not in ncfg["kinds"] or \
                SEVERITY_RANK.get(event.severity, 1) < SEVERITY_RANK[ncfg["min_severity"]]:
            return "disabled"
        start = time.monotonic()
        path = _state_path(cfg, local_node(cfg, event.node))
        conn = _connect(path, timeout_s=max(0.2, min(1.0, budget_s / 4)))
        try:
            now = time.time()
            decision, repeats, since = _gate(conn, ncfg, event, now)
            urls = {_url_id(u): u for u in ncfg["urls"]}
            if decision == "suppressed":
                return "suppressed"
            title, body = render(event, ncfg["title_prefix"], repeats, since)
            if decision == "held":  # over the rate limit: kept, leaves in the next digest
                _spool(conn, event, title, body, list(urls), "held", now)
                return "suppressed"
            row_id = _spool(conn, event, title, body, list(urls), "pending", now)
        finally:
            conn.close()
        left = budget_s - (time.monotonic() - start)
        done = _deliver(path, [(row_id, title, body, event.severity, list(urls))], urls, left)
        return "sent" if done.get(row_id) else "spooled"
    except Exception as e:  # noqa: BLE001 - notifying must never break a prolog
        _log(f"emit {event.kind} {event.node}: {type(e).__name__}: {e}")
        return "spooled" if row_id is not None else "suppressed"


def _group_digests(conn: Any, ncfg: dict[str, Any], urls: list[str], now: float) -> None:
    """For every closed fleet-wide group past its threshold, claim it (O_EXCL) and spool one digest."""
    root = os.path.join(ncfg["shared_dir"], "groups")
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        gdir = os.path.join(root, name)
        try:
            bucket = int(name.rsplit("__", 1)[1])
        except (IndexError, ValueError):
            continue
        if (bucket + 1) * ncfg["group_window_s"] > now:
            continue  # still open
        try:
            members = [m for m in os.listdir(gdir) if m.endswith(".json")]
            if len(members) <= ncfg["group_threshold"]:
                continue
            fd = os.open(os.path.join(gdir, "digest.claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(fd, f"{socket.gethostname()} {now}\n".encode())
            os.close(fd)
        except FileExistsError:
            continue  # another node sends (or sent) it
        except OSError:
            continue
        events = []
        for m in members:
            try:
                with open(os.path.join(gdir, m)) as f:
                    events.append(json.load(f))
            except (OSError, ValueError):
                events.append({"node": m[:-5], "kind": name.split("__")[0], "message": "(unreadable)"})
        title, body = render_digest(events, ncfg["title_prefix"],
                                    f"{len(events)} nodes reported the same problem within "
                                    f"{ncfg['group_window_s']:g} s; the first {ncfg['group_threshold']} were sent "
                                    "individually, this digest lists all of them.")
        severity = max((e.get("severity", "warning") for e in events), key=lambda s: SEVERITY_RANK.get(s, 1))
        _spool(conn, None, title, body, urls, "pending", now, severity)


def _held_digest(conn: Any, ncfg: dict[str, Any], urls: list[str], now: float) -> None:
    held = conn.execute("SELECT id, event FROM notify_spool WHERE status='held' ORDER BY id").fetchall()
    if not held:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("DELETE FROM notify_sent WHERE ts < ?", (now - ncfg["rate_window_s"],))
        if conn.execute("SELECT COUNT(*) FROM notify_sent").fetchone()[0] >= ncfg["rate_limit"]:
            conn.execute("COMMIT")
            return
        events = [json.loads(e) for _, e in held if e]
        title, body = render_digest(events, ncfg["title_prefix"],
                                    f"{len(events)} notifications were held back by the rate limit "
                                    f"({ncfg['rate_limit']} per {ncfg['rate_window_s']:g} s):")
        severity = max((e.get("severity", "warning") for e in events), key=lambda s: SEVERITY_RANK.get(s, 1))
        conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
        _spool(conn, None, title, body, urls, "pending", now, severity)
        marks = ",".join("?" * len(held))
        conn.execute(f"UPDATE notify_spool SET status='digested' WHERE id IN ({marks})", [i for i, _ in held])
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def flush(cfg: "Config", budget_s: float = 5.0) -> int:
    """Retry spooled messages, send digests (rate-limited events, closed fleet-wide groups). Returns how many
    messages were delivered within `budget_s`. Never raises."""
    try:
        ncfg = _enabled(cfg)
        if ncfg is None:
            return 0
        start = time.monotonic()
        path = _state_path(cfg, local_node(cfg))
        conn = _connect(path, timeout_s=max(0.2, min(1.0, budget_s / 4)))
        urls = {_url_id(u): u for u in ncfg["urls"]}
        try:
            now = time.time()
            conn.execute("UPDATE notify_spool SET status='expired' WHERE status IN ('pending','held') AND created < ?",
                         (now - ncfg["spool_max_age_h"] * 3600,))
            if ncfg["shared_dir"]:
                _group_digests(conn, ncfg, list(urls), now)
            _held_digest(conn, ncfg, list(urls), now)
            rows = [(i, t, b, s or "warning", json.loads(tg)) for i, t, b, s, tg in conn.execute(
                "SELECT id, title, body, severity, targets FROM notify_spool WHERE status='pending' AND next_try<=? "
                "ORDER BY id LIMIT 50", (now,))]
        finally:
            conn.close()
        done = _deliver(path, rows, urls, budget_s - (time.monotonic() - start))
        return sum(1 for ok in done.values() if ok)
    except Exception as e:  # noqa: BLE001
        _log(f"flush: {type(e).__name__}: {e}")
        return 0


def spool_status(cfg: "Config", node: Optional[str] = None) -> dict[str, int]:
    """Counts of spooled messages by status (for `gpuguard status`)."""
    if _enabled(cfg) is None:
        return {}
    path = _state_path(cfg, node or local_node(cfg))
    if not os.path.exists(path):
        return {}
    conn = _connect(path, timeout_s=1.0)
    try:
        return {s: n for s, n in conn.execute("SELECT status, COUNT(*) FROM notify_spool GROUP BY status")}
    finally:
        conn.close()
