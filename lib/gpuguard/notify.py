"""Notifications through apprise (Slack, webhooks, email, SNS, PagerDuty, Opsgenie, ... by URL in `notify.urls`).

    emit(cfg, Event(kind="drain", node="node2", message=..., check_id="gpu.xid", action="reboot", ...))

**Episodes and dedupe keys.** Every event has a stable dedupe key (`Event.key`: `gpuguard/node2/drain`,
`gpuguard/node7/monitor.gpu_clock/gpu3/job5150`, `gpuguard/job5150/hang`, ...). An *episode* runs from the first
failure until a "resolved" message with the same key (`Event(state="resolved")`, or an `undrain`); repeats inside
an episode are counted, not re-sent, and the resolved message says how many there were and how long it lasted.
An episode that nothing repeated or resolved for `dedup_window_s` is over (the fallback for alerts that never
resolve). A drain or a FLAPPING pin is a transition Slurm confirmed and is always sent. Receivers get the key the
way they understand it: `pagerduty://` URLs get `dedup=<key>&action=map` (a resolved message resolves the
incident), `opsgenie://` URLs `alias=<key>`, `json://`/`form://`/`xml://` webhooks a `dedup_key` and a `status`
(firing | resolved) field, everyone else a `dedup:` line in the body.

Three gates before anything is sent, so that one bad rack does not page 500 times:

1. **episodes**, as above;
2. **fleet-wide grouping** (root hooks only, when `shared_dir` names a directory on a shared filesystem): each
   node drops a marker file per (kind, check, time window); once more than `group_threshold` nodes have one,
   later nodes stay quiet and one digest naming every node (`node[001-037]`) goes out when the window closes,
   sent by whichever node's `flush` claims it first (O_EXCL file creation: atomic on local and NFSv3+
   filesystems). The directory is a trust boundary: it is walked with `openat`-style calls and O_NOFOLLOW, used
   only when every component is owned by root (or `trusted_user`) and not writable by others, and member and
   claim files count only when they are regular files with a trusted owner (size-bounded, parsed strictly).
   A user can neither push a group over its threshold nor claim its digest;
3. **rate limit**: at most `rate_limit` messages per `rate_window_s` from one state file; the rest are held and
   leave as one digest when there is room again (a resolved message whose alert went out is never held).

What cannot be delivered (network down, a webhook timing out) stays in a spool table (`notify_spool`) and is
retried by `flush()`, which the health check, the watch daemon and the monitor call periodically. Root hooks keep
that state in the history store (`notify.state_path`, default `store.path`); the monitor, which runs as the job's
user, passes its own (`user_state_path()`: in the job directory) and never touches the hooks' state or
`shared_dir`. Delivery runs in a worker thread: `emit` never blocks longer than its budget and never raises.
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
from typing import TYPE_CHECKING, Any, Iterable, Optional

from gpuguard.hostlist import compress_hostlist
from gpuguard.notify_shared import (RESOLVING_KINDS, STATES, Untrusted, gate_group, log_warning, open_trusted_dir,
                                    parse_member, state_trust_problem, trusted_uids)

if TYPE_CHECKING:
    from gpuguard.config import Config

KINDS = ("drain", "undrain", "prolog_failure", "straggler", "hang", "requeue", "internal_error", "flapping",
         "resource", "unknown_xid", "gave_up")  # resource: a monitor threshold (CPU, memory, disk, GPU temperature/power/ECC) during a job
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
# The episode an event belongs to: an undrain resolves the node's drain; FLAPPING is the same drain, escalated.
FAMILY = {"undrain": "drain", "flapping": "drain"}
# Transitions Slurm confirmed (a node that was not drained by gpuguard is drained now; its reason became
# FLAPPING): never folded into an open episode, whatever the state says (a missed resolve must not silence them).
ALWAYS_SEND = {"drain", "flapping"}
JOB_FAMILIES = {"straggler", "hang", "resource", "requeue", "gave_up"}  # their keys name the job (one incident per job)
MAX_KEY_LEN = 255  # PagerDuty's dedup_key limit

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
    "gave_up": "the job will not run again by itself: read its ledger (attempts.jsonl in the job directory) and "
               "output, fix the cause, resubmit",
    "internal_error": "a gpuguard bug or an unreadable config: see the log (nodes were not drained: fail-open)",
    "flapping": "the node keeps failing and recovering: inspect the hardware before undraining it by hand",
    "resource": "look at what the job is doing on the node (memory, disk, data loader workers); the job may fail",
    "unknown_xid": "look the code up in NVIDIA's Xid catalog (`gpuguard xid explain CODE`) and, if it is a fault, "
                   "add `xid: {overrides: {CODE: {severity: fatal}}}`; the node was not drained for it",
}
_TITLES = {"drain": "DRAINED", "undrain": "undrained", "prolog_failure": "prolog failed", "straggler": "straggler",
           "hang": "job hang", "requeue": "job requeue requested", "internal_error": "internal error",
           "flapping": "flapping node", "resource": "resource alarm", "unknown_xid": "unknown Xid",
           "gave_up": "job GAVE UP"}


@dataclass
class Event:
    kind: str  # drain|undrain|prolog_failure|straggler|hang|requeue|internal_error|flapping|resource
    node: str
    message: str
    severity: str = "warning"  # critical|warning|info
    check_id: Optional[str] = None
    action: Optional[str] = None
    reason: Optional[str] = None
    job_id: Optional[str] = None
    evidence: dict = field(default_factory=dict)  # type: ignore[type-arg]
    ts: float = field(default_factory=time.time)
    state: str = "firing"  # firing | resolved (the alert with the same key has cleared)
    gpu: Optional[int] = None  # the GPU (index) a per-GPU alert is about: part of its key
    # what identifies the GPUs concerned in the hardware: [{index, uuid, serial, pci_bus_id}] (see gpu_identities)
    gpus: list = field(default_factory=list)  # type: ignore[type-arg]
    scope: str = "node"  # node | job: a job-wide condition (one incident per job, whichever node reports it)
    dedup_key: Optional[str] = None  # an explicit stable key; default: see dedupe_key()

    @property
    def resolved(self) -> bool:
        return self.state == "resolved" or self.kind in RESOLVING_KINDS

    @property
    def family(self) -> str:
        return FAMILY.get(self.kind, self.kind)

    @property
    def key(self) -> str:
        return dedupe_key(self)


# --------------------------------------------------------------------------- pure helpers


def _part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:@+-]", "_", str(text))[:100] or "_"


def dedupe_key(event: Event, prefix: str = "gpuguard") -> str:
    """The stable key of the incident an event belongs to: the same for its repeats and for its resolution,
    different for another node, GPU, check or job. Pure. `<prefix>/<node or jobJ>/<family>[/<check>][/gpuN][/jobJ]`
    (a drain is about the node: one per node at a time)."""
    if event.dedup_key:
        key = "/".join(_part(p) for p in event.dedup_key.split("/"))
    else:
        fam = event.family
        job_scope = event.scope == "job" and bool(event.job_id)
        parts = [prefix, f"job{event.job_id}" if job_scope else event.node, fam]
        if fam != "drain" and not (job_scope and fam == "hang"):
            parts.append(event.check_id or "-")
        if event.gpu is not None and not job_scope:
            parts.append(f"gpu{event.gpu}")
        if event.job_id and not job_scope and fam in JOB_FAMILIES:
            parts.append(f"job{event.job_id}")
        key = "/".join(_part(p) for p in parts)
    if len(key) > MAX_KEY_LEN:
        key = key[:MAX_KEY_LEN - 17] + "~" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return key


def iso_utc(ts: Optional[float]) -> str:
    """2026-11-24T20:06:33Z (now when `ts` is None)."""
    from gpuguard.timefmt import iso_utc as fmt

    return str(fmt(ts if ts is not None else time.time()))


def _duration(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    d, rest = divmod(s, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}d" if d else "") + (f"{h}h" if h or d else "") + (f"{m:02d}m{s:02d}s" if h or d else f"{m}m{s:02d}s")


def _evidence_text(evidence: dict, limit: int = 1200) -> str:  # type: ignore[type-arg]
    text = "; ".join(f"{k}={json.dumps(v, default=str, separators=(',', ':'))}" for k, v in evidence.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gpu_identities(nvml: Any, indices: Iterable[Optional[int]]) -> list[dict[str, Any]]:
    """UUID, serial and PCI address of the GPUs with these NVML indices, from the run's NVML observation
    (`observations.nvml`; anything with `.gpus[*].index/.uuid/.serial/.pci_bus_id`). A GPU NVML no longer sees
    (fallen off the bus) is listed by index alone. Pure."""
    by_index = {getattr(g, "index", None): g for g in (getattr(nvml, "gpus", None) or [])}
    out = []
    for i in dict.fromkeys(i for i in indices if i is not None):
        g = by_index.get(i)
        ident: dict[str, Any] = {"index": i}
        for attr in ("uuid", "serial", "pci_bus_id"):
            value = getattr(g, attr, None) if g is not None else None
            if value:
                ident[attr] = str(value)
        out.append(ident)
    return out


def _gpu_line(g: dict[str, Any]) -> str:
    bits = [f"GPU {g.get('index', '?')}"]
    for attr, label in (("uuid", "uuid"), ("serial", "serial"), ("pci_bus_id", "pci")):
        if g.get(attr):
            bits.append(f"{label}={g[attr]}")
    if len(bits) == 1:
        bits.append("(not visible to NVML: no UUID/serial)")
    return " ".join(bits)


def render(event: Event, prefix: str = "gpuguard", repeats: int = 0, since: Optional[float] = None,
           opened: Optional[float] = None) -> tuple[str, str]:
    """(title, body) naming the node, the check, the GPUs (UUID, serial), the evidence, the suggested action and
    the dedupe key; a resolved message also says since when it fired and how often. Pure."""
    what = _TITLES.get(event.kind, event.kind)
    title = f"{prefix}: {'RESOLVED ' if event.resolved else ''}{what} {event.node}" + \
        (f" {event.check_id}" if event.check_id else "")
    state = "resolved" if event.resolved else "firing"
    lines = [
        f"node:     {event.node}",
        f"event:    {event.kind} ({event.severity})",
        f"status:   {state}",
        f"check:    {event.check_id or '-'}",
        f"what:     {event.message}",
    ]
    if event.reason:
        lines.append(f"reason:   {event.reason}")
    if event.job_id:
        lines.append(f"job:      {event.job_id}")
    for g in event.gpus or []:
        if isinstance(g, dict):
            lines.append(f"gpu:      {_gpu_line(g)}")
    lines.append(f"evidence: {_evidence_text(event.evidence) if event.evidence else '-'}")
    if event.action:
        action = event.action
    elif event.resolved and event.kind not in RESOLVING_KINDS:
        action = "none: the condition cleared"
    else:
        action = DEFAULT_ACTIONS.get(event.kind, "see the gpuguard log")
    lines.append(f"action:   {action}")
    lines.append(f"when:     {iso_utc(event.ts)}")
    if event.resolved and opened is not None:
        lines.append(f"fired:    {iso_utc(opened)} (lasted {_duration(event.ts - opened)})")
    lines.append(f"dedup:    {dedupe_key(event, prefix)}")
    if repeats:
        first = iso_utc(since) if since else "earlier"
        lines.append(f"(also happened {repeats} more time(s) since {first}; those were not sent separately)")
    return title, "\n".join(lines)


def _label(e: dict[str, Any]) -> str:
    kind = str(e.get("kind") or "?")
    return f"{kind} resolved" if e.get("state") == "resolved" and kind not in RESOLVING_KINDS else kind


def render_digest(events: list[dict[str, Any]], prefix: str, why: str) -> tuple[str, str]:
    """One message for many events (held by the rate limit, or a fleet-wide group). Pure."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in events:
        by.setdefault((_label(e), e.get("check_id") or "-"), []).append(e)
    nodes = sorted({str(e.get("node")) for e in events})
    title = f"{prefix}: {len(events)} events on {len(nodes)} node(s): {compress_hostlist(nodes)}"
    lines = [f"{why}", ""]
    for (kind, check), evs in sorted(by.items()):
        worst = max(evs, key=lambda e: SEVERITY_RANK.get(e.get("severity", "warning"), 1))
        lines.append(f"{kind} {check} x{len(evs)} on {compress_hostlist(str(e.get('node')) for e in evs)} "
                     f"({worst.get('severity', 'warning')})")
        lines.append(f"  e.g. {worst.get('node')}: {worst.get('message')}")
        if worst.get("reason"):
            lines.append(f"  reason: {worst['reason']}")
        base_kind = str(worst.get("kind"))
        lines.append(f"  action: {worst.get('action') or DEFAULT_ACTIONS.get(base_kind, 'see the gpuguard log')}")
    return title, "\n".join(lines)


def _url_id(url: str) -> str:
    """Spool rows name targets by hash: URLs carry tokens and passwords, the spool file should not."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def _query_keys(url: str) -> set[str]:
    query = url.split("?", 1)[1] if "?" in url else ""
    return {kv.split("=", 1)[0].lower() for kv in query.split("&") if kv}


def target_url(url: str, key: Optional[str], state: str, timeout_s: Optional[float] = None) -> str:
    """The configured apprise URL with what this one message needs: the dedupe key where the service has a
    field for it, whether it resolves, and the delivery timeout. A parameter the admin set wins. Pure."""
    from urllib.parse import quote

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    have = _query_keys(url)
    add: list[tuple[str, str]] = []
    if key:
        if scheme == "pagerduty":  # apprise: dedup -> dedup_key; action=map resolves on a SUCCESS notification
            add += [("dedup", key), ("action", "map")]
        elif scheme == "opsgenie":  # Opsgenie de-duplicates open alerts by alias
            add += [("alias", key)]
        elif scheme in ("json", "jsons", "form", "forms", "xml", "xmls"):  # ":field=value" adds a payload field
            add += [(":dedup_key", key), (":status", state)]
    if timeout_s:
        add += [("cto", f"{timeout_s:g}"), ("rto", f"{timeout_s:g}")]
    extra = "&".join(f"{k}={quote(v, safe='')}" for k, v in add if k.lower() not in have)
    if not extra:
        return url
    return url + ("&" if "?" in url else "?") + extra


# --------------------------------------------------------------------------- state (SQLite)

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
# Columns added since the first release (ALTER TABLE on an existing state file)
_ADDED_COLUMNS = {
    "notify_keys": (("opened", "REAL"), ("last_seen", "REAL"), ("is_open", "INTEGER"),
                    ("announced", "INTEGER NOT NULL DEFAULT 0")),
    "notify_spool": (("dedup_key", "TEXT"), ("state", "TEXT")),
}


def local_node(cfg: "Config", fallback: Optional[str] = None) -> str:
    return (cfg.sections["node"].get("name") or os.environ.get("SLURMD_NODENAME") or fallback
            or socket.gethostname().split(".")[0])


def _state_path(cfg: "Config", node: str) -> str:
    n = cfg.sections["notify"]
    return (n["state_path"] or cfg.sections["store"]["path"]).replace("{node}", node)


def user_state_path(cfg: "Config", job_dir: str, job_id: Optional[str], node: str) -> str:
    """Where the monitor (the job's user) keeps its own notification state: `notify.user_state_path` or
    `<job dir>/gpuguard/notify/<node>.db`. Never the hooks' state (root's history store)."""
    template = (cfg.sections.get("notify") or {}).get("user_state_path") or \
        os.path.join("{job_dir}", "gpuguard", "notify", "{node}.db")
    safe_node = re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "_"
    return (template.replace("{job_dir}", job_dir).replace("{job_id}", str(job_id or "nojob"))
            .replace("{node}", safe_node).replace("{uid}", str(os.geteuid())))


def _migrate(conn: Any) -> None:
    conn.executescript(_SCHEMA)
    for table, cols in _ADDED_COLUMNS.items():
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        for name, decl in cols:
            if name not in have:
                try:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
                except Exception as e:  # noqa: BLE001 - another process added it between our look and ours
                    if "duplicate column" not in str(e):
                        raise


def _connect(path: str, timeout_s: float) -> Any:
    """The hooks' state: the history store (WAL, busy timeout, a corrupt file is moved aside)."""
    from gpuguard.store import Store

    store = Store(path, timeout_s=timeout_s)
    _migrate(store.conn)
    return store.conn


def _connect_user(path: str, timeout_s: float) -> Any:
    """The monitor's own state: a small SQLite file of its own (rollback journal, not WAL: it may sit on the job
    directory's network filesystem, where WAL does not work), created private (0700 directory, 0600 file)."""
    import sqlite3

    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    for attempt in (1, 2):
        conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=%d" % int(timeout_s * 1000))
            _migrate(conn)
            return conn
        except sqlite3.DatabaseError as e:
            conn.close()
            if attempt == 2 or "malformed" not in str(e) and "not a database" not in str(e):
                raise
            os.replace(path, f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
            _log(f"notification state {path} was corrupt ({e}); moved aside, starting a new one")
    raise AssertionError("unreachable")


_log = log_warning
__all__ = ["Event", "Untrusted", "compress_hostlist", "dedupe_key", "emit", "flush", "gpu_identities", "iso_utc",
           "open_trusted_dir", "parse_member", "render", "render_digest", "spool_status", "target_url",
           "trusted_uids", "user_state_path"]


def _member_record(event: Event) -> dict[str, Any]:
    """What a node writes into its group marker: enough for the digest, bounded (no evidence)."""
    return {"node": event.node, "kind": event.kind, "check_id": event.check_id, "severity": event.severity,
            "message": event.message[:1000], "reason": (event.reason or None) and event.reason[:300],
            "action": (event.action or None) and event.action[:500], "job_id": event.job_id, "ts": event.ts,
            "state": "resolved" if event.resolved else "firing"}


# --------------------------------------------------------------------------- gates


@dataclass
class _Decision:
    verdict: str  # send | suppressed | held
    repeats: int = 0
    since: Optional[float] = None
    opened: Optional[float] = None


def _upsert_key(conn: Any, key: str, **cols: Any) -> None:
    names = ["key"] + list(cols)
    conn.execute(f"INSERT INTO notify_keys({','.join(names)}) VALUES ({','.join('?' * len(names))}) "
                 f"ON CONFLICT(key) DO UPDATE SET {', '.join(f'{c}=excluded.{c}' for c in cols)}",
                 [key] + list(cols.values()))


def _rate_full(conn: Any, ncfg: dict[str, Any], now: float) -> bool:
    conn.execute("DELETE FROM notify_sent WHERE ts < ?", (now - ncfg["rate_window_s"],))
    return conn.execute("SELECT COUNT(*) FROM notify_sent").fetchone()[0] >= ncfg["rate_limit"]


def _gate(conn: Any, ncfg: dict[str, Any], event: Event, key: str, now: float,
          group_uids: Optional[set[int]]) -> _Decision:
    """Episodes, the fleet-wide group (when `group_uids`: root hooks with a shared_dir) and the rate limit, in
    one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT last_sent, suppressed, first_suppressed, opened, last_seen, is_open, announced "
                           "FROM notify_keys WHERE key=?", (key,)).fetchone()
        last_sent, suppressed, first_suppressed, opened, last_seen, is_open, announced = \
            row if row else (None, 0, None, None, None, 0, 0)
        if is_open is None:  # a row from before episodes: open while its last message is within the window
            is_open, last_seen = int(last_sent is not None), last_seen or last_sent
        open_now = bool(is_open) and last_seen is not None and now - last_seen < ncfg["dedup_window_s"]

        def grouped() -> bool:
            if group_uids is None:
                return False
            try:
                return gate_group(ncfg["shared_dir"], group_uids, _member_record(event), now,
                                  ncfg["group_window_s"], ncfg["group_threshold"])
            except OSError as e:  # untrusted or down: never let it stop local paging
                _log(f"shared_dir {ncfg['shared_dir']} not used ({e}); paging individually")
                return False

        if event.resolved:
            _upsert_key(conn, key, is_open=0, last_seen=now, suppressed=0, first_suppressed=None)
            if not ncfg.get("send_resolved", True):
                conn.execute("COMMIT")
                return _Decision("suppressed")
            decision = _Decision("send", suppressed if open_now else 0, first_suppressed if open_now else None,
                                 opened if (open_now or is_open) else None)
            if not (is_open and announced):  # its alert was not sent on its own: treat it like any message
                if grouped():
                    conn.execute("COMMIT")
                    return _Decision("suppressed")
                if _rate_full(conn, ncfg, now):
                    conn.execute("COMMIT")
                    return _Decision("held")
            conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
            conn.execute("COMMIT")
            return decision

        if open_now and event.kind not in ALWAYS_SEND:
            conn.execute("UPDATE notify_keys SET suppressed=suppressed+1, "
                         "first_suppressed=COALESCE(first_suppressed,?), last_seen=? WHERE key=?", (now, now, key))
            conn.execute("COMMIT")
            return _Decision("suppressed")
        # a new episode (or a transition Slurm confirmed); an episode that expired hands on its count
        carried = (suppressed, first_suppressed) if suppressed else (0, None)
        start = opened if open_now and opened and event.kind != "drain" else now  # FLAPPING escalates the drain
        if grouped():
            _upsert_key(conn, key, is_open=1, opened=start, last_seen=now, announced=0, suppressed=0,
                        first_suppressed=None)
            conn.execute("COMMIT")
            return _Decision("suppressed")
        if _rate_full(conn, ncfg, now):
            _upsert_key(conn, key, is_open=1, opened=start, last_seen=now, announced=0, suppressed=0,
                        first_suppressed=None)
            conn.execute("COMMIT")
            return _Decision("held")
        conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
        _upsert_key(conn, key, is_open=1, opened=start, last_seen=now, last_sent=now, announced=1, suppressed=0,
                    first_suppressed=None)
        conn.execute("COMMIT")
        return _Decision("send", carried[0], carried[1], start)
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _spool(conn: Any, event: Optional[Event], title: str, body: str, targets: list[str], status: str,
           now: float, severity: Optional[str] = None, key: Optional[str] = None,
           state: Optional[str] = None) -> int:
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


# --------------------------------------------------------------------------- delivery

Row = tuple[int, str, str, str, list[str], Optional[str], str]  # id, title, body, severity, targets, key, state


def _notify_type(apprise: Any, severity: str, state: str = "firing") -> Any:
    if state == "resolved":
        return apprise.NotifyType.SUCCESS  # PagerDuty (action=map) resolves, Opsgenie (map) closes
    return {"critical": apprise.NotifyType.FAILURE, "warning": apprise.NotifyType.WARNING}.get(
        severity, apprise.NotifyType.INFO)


def _send_one(apprise: Any, url: str, title: str, body: str, severity: str, key: Optional[str], state: str,
              timeout_s: Optional[float]) -> tuple[bool, Optional[str]]:
    """(delivered, error). An invalid URL is permanent: reported as delivered-with-error so it is not retried."""
    client = apprise.Apprise()
    if not client.add(target_url(url, key, state, timeout_s)):
        return True, "invalid URL"
    try:
        ok = bool(client.notify(title=title, body=body, notify_type=_notify_type(apprise, severity, state),
                                body_format=apprise.NotifyFormat.TEXT))
    except Exception as e:  # noqa: BLE001 - a plugin bug must not lose the message
        return False, f"{type(e).__name__}: {e}"
    return ok, None if ok else "delivery failed"


def _deliver_rows(path: str, rows: list[Row], urls: dict[str, str], done: dict[int, bool],
                  timeout_s: Optional[float]) -> None:
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
        for row_id, title, body, severity, targets, key, state in rows:
            left, errors = [], []
            for tid in targets:
                url = urls.get(tid)
                if url is None:
                    continue  # that URL was removed from the config: nobody to deliver to
                ok, err = _send_one(apprise, url, title, body, severity, key, state, timeout_s)
                if err:
                    errors.append(f"#{tid}: {err}")
                if not ok:
                    left.append(tid)
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


def _deliver(path: str, rows: list[Row], urls: dict[str, str], budget_s: float,
             timeout_s: Optional[float]) -> dict[int, bool]:
    done: dict[int, bool] = {}
    if not rows:
        return done
    t = threading.Thread(target=_deliver_rows, args=(path, rows, urls, done, timeout_s), name="gpuguard-notify",
                         daemon=True)
    t.start()
    t.join(max(0.0, budget_s))
    return dict(done)


def _deliver_direct(ncfg: dict[str, Any], event: Event, budget_s: float) -> str:
    """No usable state (it is not trusted): send straight away, without gates or spool. Better a duplicate page
    than a silenced drain."""
    title, body = render(event, ncfg["title_prefix"])
    key = dedupe_key(event, ncfg["title_prefix"])
    state = "resolved" if event.resolved else "firing"
    result: dict[str, bool] = {}

    def run() -> None:
        try:
            import apprise
        except ImportError:
            return
        result["ok"] = all(_send_one(apprise, u, title, body, event.severity, key, state, ncfg["timeout_s"])[0]
                           for u in ncfg["urls"])

    t = threading.Thread(target=run, name="gpuguard-notify-direct", daemon=True)
    t.start()
    t.join(max(0.0, budget_s))
    return "sent" if result.get("ok") else "failed"


def _enabled(cfg: "Config") -> Optional[dict[str, Any]]:
    ncfg = cfg.sections.get("notify")
    return ncfg if ncfg and ncfg.get("urls") else None


def _wanted(ncfg: dict[str, Any], event: Event) -> bool:
    if event.kind not in ncfg["kinds"]:
        return False
    if event.resolved:
        return bool(ncfg.get("send_resolved", True))  # its alert passed min_severity: so does its resolution
    return SEVERITY_RANK.get(event.severity, 1) >= SEVERITY_RANK[ncfg["min_severity"]]


# --------------------------------------------------------------------------- the API


def emit(cfg: "Config", event: Event, budget_s: float = 2.0, state_path: Optional[str] = None) -> str:
    """Send `event` (or fold it into its episode / a digest / the spool). Returns "sent" | "suppressed" |
    "spooled" | "disabled" | "failed" (the state could not be used and direct delivery failed too).
    `state_path`: a caller with its own state (the monitor, as the job's user; see user_state_path) — it never
    uses shared_dir. Never raises, never takes longer than `budget_s` (plus the state's lock timeout).
    A state that cannot be used (untrusted, full disk, read-only, locked) never silences a message: it is then
    delivered directly, without de-duplication or spool."""
    row_id: Optional[int] = None
    ncfg = None
    start = time.monotonic()
    try:
        ncfg = _enabled(cfg)
        if ncfg is None or not _wanted(ncfg, event):
            return "disabled"
        own_state = state_path is not None
        path = state_path or _state_path(cfg, local_node(cfg, event.node))
        group_uids: Optional[set[int]] = None
        if not own_state:
            uids = trusted_uids(ncfg)
            why = state_trust_problem(path, uids)
            if why:
                _log(f"not using notification state ({why}); delivering {event.kind} {event.node} directly")
                return _deliver_direct(ncfg, event, budget_s)
            if ncfg["shared_dir"]:
                group_uids = uids
        timeout = max(0.2, min(1.0, budget_s / 4))
        key = dedupe_key(event, ncfg["title_prefix"])
        state = "resolved" if event.resolved else "firing"
        urls = {_url_id(u): u for u in ncfg["urls"]}
        conn = _connect_user(path, timeout) if own_state else _connect(path, timeout)
        try:
            now = time.time()
            d = _gate(conn, ncfg, event, key, now, group_uids)
            if d.verdict == "suppressed":
                return "suppressed"
            title, body = render(event, ncfg["title_prefix"], d.repeats, d.since, d.opened)
            if d.verdict == "held":  # over the rate limit: kept, leaves in the next digest
                _spool(conn, event, title, body, list(urls), "held", now, key=key)
                return "suppressed"
            row_id = _spool(conn, event, title, body, list(urls), "pending", now, key=key)
        finally:
            conn.close()
        left = budget_s - (time.monotonic() - start)
        done = _deliver(path, [(row_id, title, body, event.severity, list(urls), key, state)], urls, left,
                        ncfg["timeout_s"])
        return "sent" if done.get(row_id) else "spooled"
    except Exception as e:  # noqa: BLE001 - notifying must never break a prolog
        _log(f"emit {event.kind} {event.node}: {type(e).__name__}: {e}")
        if row_id is not None:
            return "spooled"
        if ncfg is None:
            return "suppressed"
        try:  # the state failed us before the message was kept: it goes out directly
            return _deliver_direct(ncfg, event, max(0.0, budget_s - (time.monotonic() - start)))
        except Exception as e2:  # noqa: BLE001
            _log(f"emit {event.kind} {event.node}: direct delivery: {type(e2).__name__}: {e2}")
            return "failed"


def _group_digests(conn: Any, ncfg: dict[str, Any], uids: set[int], urls: list[str], now: float) -> None:
    """For every closed fleet-wide group past its threshold that this node claims (O_EXCL), spool one digest."""
    from gpuguard.notify_shared import closed_groups

    try:
        groups = closed_groups(ncfg["shared_dir"], uids, now, ncfg["group_window_s"], ncfg["group_threshold"],
                               keep_s=max(86400.0, ncfg["spool_max_age_h"] * 3600))
    except OSError as e:
        _log(f"shared_dir {ncfg['shared_dir']} not used ({e}); no fleet-wide digests")
        return
    for name, end, events in groups:
        title, body = render_digest(events, ncfg["title_prefix"],
                                    f"{len(events)} nodes reported the same problem within "
                                    f"{ncfg['group_window_s']:g} s (window ending {iso_utc(end)}); the first "
                                    f"{ncfg['group_threshold']} were sent individually, this digest lists all of "
                                    "them.")
        severity = max((e.get("severity", "warning") for e in events), key=lambda s: SEVERITY_RANK.get(s, 1))
        all_resolved = all(e.get("state") == "resolved" for e in events)
        _spool(conn, None, title, body, urls, "pending", now, severity,
               key=f"{_part(ncfg['title_prefix'])}/digest/{name}", state="resolved" if all_resolved else "firing")


def _held_digest(conn: Any, ncfg: dict[str, Any], urls: list[str], now: float) -> None:
    held = conn.execute("SELECT id, event FROM notify_spool WHERE status='held' ORDER BY id").fetchall()
    if not held:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _rate_full(conn, ncfg, now):
            conn.execute("COMMIT")
            return
        events = [json.loads(e) for _, e in held if e]
        title, body = render_digest(events, ncfg["title_prefix"],
                                    f"{len(events)} notifications were held back by the rate limit "
                                    f"({ncfg['rate_limit']} per {ncfg['rate_window_s']:g} s):")
        severity = max((e.get("severity", "warning") for e in events), key=lambda s: SEVERITY_RANK.get(s, 1))
        conn.execute("INSERT INTO notify_sent(ts) VALUES (?)", (now,))
        all_resolved = all(e.get("state") == "resolved" for e in events)
        _spool(conn, None, title, body, urls, "pending", now, severity,
               key=f"{_part(ncfg['title_prefix'])}/digest/held/{int(now)}",
               state="resolved" if all_resolved else "firing")
        marks = ",".join("?" * len(held))
        conn.execute(f"UPDATE notify_spool SET status='digested' WHERE id IN ({marks})", [i for i, _ in held])
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def flush(cfg: "Config", budget_s: float = 5.0, state_path: Optional[str] = None) -> int:
    """Retry spooled messages, send digests (rate-limited events, closed fleet-wide groups: root hooks only).
    Returns how many messages were delivered within `budget_s`. Never raises."""
    try:
        ncfg = _enabled(cfg)
        if ncfg is None:
            return 0
        start = time.monotonic()
        own_state = state_path is not None
        path = state_path or _state_path(cfg, local_node(cfg))
        uids = trusted_uids(ncfg)
        if not own_state:
            why = state_trust_problem(path, uids)
            if why:
                _log(f"not using notification state ({why}); nothing flushed")
                return 0
        timeout = max(0.2, min(1.0, budget_s / 4))
        conn = _connect_user(path, timeout) if own_state else _connect(path, timeout)
        urls = {_url_id(u): u for u in ncfg["urls"]}
        try:
            now = time.time()
            conn.execute("UPDATE notify_spool SET status='expired' WHERE status IN ('pending','held') AND created < ?",
                         (now - ncfg["spool_max_age_h"] * 3600,))
            if ncfg["shared_dir"] and not own_state:
                _group_digests(conn, ncfg, uids, list(urls), now)
            _held_digest(conn, ncfg, list(urls), now)
            rows: list[Row] = [(i, t, b, s or "warning", json.loads(tg), k, st or "firing")
                               for i, t, b, s, tg, k, st in conn.execute(
                "SELECT id, title, body, severity, targets, dedup_key, state FROM notify_spool "
                "WHERE status='pending' AND next_try<=? ORDER BY id LIMIT 50", (now,))]
        finally:
            conn.close()
        done = _deliver(path, rows, urls, budget_s - (time.monotonic() - start), ncfg["timeout_s"])
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
