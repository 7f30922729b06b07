"""One batch of the outbox -> the statements that store it centrally (schema version 2, gpuguard.fleet.schema).

- A healthy run (verdict pass, no reason, no error, no problem finding: `is_healthy`, the same rule as
  `Store.HEALTHY_RUN`) is not stored itself: its node's UTC-day counts in `run_days` are recomputed from the store
  up to the batch's last row and written with an upsert that only moves forward (`upto_local_id`). Recomputing
  rather than adding is what keeps shipping idempotent: sending a batch twice writes the same count.
- A run that repeats the previous problem run of its node and kind the same UTC day (same verdict, action,
  reason, error and problem findings by check/severity/keyword/GPU; messages may differ) adds to that first run's
  `repeats` and `last_started`; any other run of that node and kind ends the streak.
- An `already drained` record that repeats the node's previous drain record (a drain mark with the same check and
  keyword, the same day; not a FLAPPING pin) adds to that record's `repeats` and `last_ts`.
The streaks carry over from batch to batch in the watermark cursor (`streaks`), which moves with the batch only
after its commit, so a batch sent again after a crash is computed from the same state and gives the same rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

from gpuguard.fleet.pg import clean_json, clean_text
from gpuguard.store.filters import keyword_of_reason
from gpuguard.fleet.tables import HOUR_COLUMNS

DRAIN_MARKS = ("done", "already", "flapping")


def _ts(value: Any) -> datetime:
    return datetime.fromtimestamp(float(value), timezone.utc)


def _int(value: Any) -> Optional[int]:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _evidence(text: Any) -> Any:
    from psycopg.types.json import Jsonb  # optional (gpuguard[fleet]): never at import time

    if text is None or text == "":
        return None
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        value = {"raw": str(text)}
    return Jsonb(clean_json(value))


def utc_day(ts: float) -> str:
    return datetime.fromtimestamp(float(ts), timezone.utc).strftime("%Y-%m-%d")


def day_start(ts: float) -> float:
    d = datetime.fromtimestamp(float(ts), timezone.utc)
    return datetime(d.year, d.month, d.day, tzinfo=timezone.utc).timestamp()


def is_healthy(run: dict[str, Any], problems: list[dict[str, Any]]) -> bool:
    """Store.HEALTHY_RUN in Python: passed, no reason, no error, no problem finding."""
    return run["verdict"] == "pass" and run.get("reason") is None and run.get("error") is None and not problems


def run_signature(run: dict[str, Any], problems: list[dict[str, Any]]) -> str:
    """What makes two problem runs "the same": verdict, action, reason, error and the problem findings."""
    key = [run["verdict"], run.get("action"), run.get("reason"), run.get("error"),
           [(p["check_id"], p["severity"], p.get("keyword"), p.get("gpu")) for p in problems]]
    return hashlib.sha1(json.dumps(key, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- statements

INSERT_RUN = ("INSERT INTO gpuguard.runs (origin, local_id, node, started, duration_ms, kind, job_id, restart_count, "
              "profile, verdict, action, reason, exit_code, error, boot_id, upto_local_id) VALUES "
              "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING")
INSERT_FINDING = ("INSERT INTO gpuguard.findings (origin, run_local_id, seq, node, started, kind, job_id, run_verdict, "
                  "check_id, severity, keyword, gpu, action, message, remediation, evidence) VALUES "
                  "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING")
INSERT_DRAIN = ("INSERT INTO gpuguard.drains (origin, local_id, node, ts, op, outcome, reason, check_id, keyword, "
                "action, run_local_id, detail, upto_local_id) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) "
                "ON CONFLICT DO NOTHING")
REPEAT_RUN = ("UPDATE gpuguard.runs SET repeats = %s, last_started = %s, upto_local_id = %s "
              "WHERE origin = %s AND local_id = %s AND started = %s AND upto_local_id < %s")
REPEAT_FINDINGS = ("UPDATE gpuguard.findings SET repeats = %s, last_started = %s "
                   "WHERE origin = %s AND run_local_id = %s AND started = %s AND repeats < %s")
REPEAT_DRAIN = ("UPDATE gpuguard.drains SET repeats = %s, last_ts = %s, upto_local_id = %s "
                "WHERE origin = %s AND local_id = %s AND ts = %s AND upto_local_id < %s")
_DAY_COLS = ["day", "origin", "node", "runs", *HOUR_COLUMNS, "kinds", "first_started", "last_started",
             "duration_ms_sum", "duration_ms_max", "upto_local_id"]
UPSERT_DAY = (f"INSERT INTO gpuguard.run_days ({', '.join(_DAY_COLS)}) VALUES ({', '.join(['%s'] * len(_DAY_COLS))}) "
              "ON CONFLICT (day, origin, node) DO UPDATE SET "
              + ", ".join(f"{c} = excluded.{c}" for c in _DAY_COLS[3:])
              + " WHERE gpuguard.run_days.upto_local_id < excluded.upto_local_id")
UPSERT_NODE = ("INSERT INTO gpuguard.nodes (node, first_seen, last_seen) VALUES (%s,%s,%s) ON CONFLICT (node) DO "
               "UPDATE SET first_seen = LEAST(gpuguard.nodes.first_seen, excluded.first_seen), "
               "last_seen = GREATEST(gpuguard.nodes.last_seen, excluded.last_seen)")


@dataclass
class Statements:
    """What one batch writes: executemany() per statement, in this order."""

    inserts: dict[str, list[tuple[Any, ...]]] = field(default_factory=lambda: {"runs": [], "findings": [],
                                                                               "drains": []})
    repeats: dict[tuple[Any, ...], tuple[Any, ...]] = field(default_factory=dict)  # head key -> (n, last, upto)
    healthy_days: set[tuple[str, float]] = field(default_factory=set)  # (node, UTC day start)
    seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (first, last) time in the batch

    def saw(self, node: str, t: float) -> None:
        first, last = self.seen.get(node, (t, t))
        self.seen[node] = (min(first, t), max(last, t))


def _prune_streaks(streaks: dict[str, Any], today: str) -> None:
    """A streak never crosses a UTC day: older ones are finished and forgotten (the cursor stays small)."""
    for key in [k for k, v in streaks.items() if v.get("day", "") < today]:
        del streaks[key]


def plan_runs(origin: str, rows: list[dict[str, Any]], problems: dict[int, list[dict[str, Any]]],
              streaks: dict[str, Any]) -> Statements:
    """Runs (oldest first) and their problem findings (by run id) -> statements; `streaks` is updated."""
    out = Statements()
    for r in rows:
        found = problems.get(int(r["id"]), [])
        key = f"{r['node']}\x1f{r['kind']}"
        out.saw(r["node"], float(r["started"]))
        if is_healthy(r, found):
            out.healthy_days.add((r["node"], day_start(r["started"])))
            streaks.pop(key, None)
            continue
        sig, day = run_signature(r, found), utc_day(r["started"])
        head = streaks.get(key)
        if head and head["sig"] == sig and head["day"] == day:
            head["repeats"] += 1
            head["last"] = float(r["started"])
            out.repeats[("runs", head["id"], head["started"])] = (head["repeats"], head["last"], int(r["id"]))
            continue
        streaks[key] = {"id": int(r["id"]), "started": float(r["started"]), "sig": sig, "day": day, "repeats": 0,
                        "last": float(r["started"])}
        out.inserts["runs"].append(run_params(origin, r))
        out.inserts["findings"] += [finding_params(origin, r, seq, f) for seq, f in enumerate(found)]
    if rows:
        _prune_streaks(streaks, utc_day(rows[-1]["started"]))
    return out


def plan_drains(origin: str, rows: list[dict[str, Any]], streaks: dict[str, Any]) -> Statements:
    """Drain records (oldest first) -> statements; `streaks` (by node) is updated."""
    out = Statements()
    for d in rows:
        node, kw, day = d["node"], (keyword_of_reason(d.get("reason")) or "").upper() or None, utc_day(d["ts"])
        out.saw(node, float(d["ts"]))
        head = streaks.get(node)
        if (d["op"] == "drain" and d["outcome"] == "already" and kw != "FLAPPING" and head
                and head["check"] == d.get("check_id") and head["kw"] == kw and head["day"] == day):
            head["repeats"] += 1
            head["last"] = float(d["ts"])
            out.repeats[("drains", head["id"], head["ts"])] = (head["repeats"], head["last"], int(d["id"]))
            continue
        out.inserts["drains"].append(drain_params(origin, d, kw))
        if d["op"] == "drain" and d["outcome"] in DRAIN_MARKS:
            streaks[node] = {"id": int(d["id"]), "ts": float(d["ts"]), "check": d.get("check_id"), "kw": kw,
                             "day": day, "repeats": 0, "last": float(d["ts"])}
        else:
            streaks.pop(node, None)
    if rows:
        _prune_streaks(streaks, utc_day(rows[-1]["ts"]))
    return out


# --------------------------------------------------------------------------- rows -> parameters


def run_params(origin: str, r: dict[str, Any]) -> tuple[Any, ...]:
    t = clean_text
    return (origin, int(r["id"]), t(r["node"]), _ts(r["started"]), r.get("duration_ms"), t(r["kind"]),
            t(r.get("job_id")), _int(r.get("restart_count")), t(r.get("profile")), t(r["verdict"]), t(r.get("action")),
            t(r.get("reason")), _int(r.get("exit_code")), t(r.get("error")), t(r.get("boot_id")), int(r["id"]))


def finding_params(origin: str, run: dict[str, Any], seq: int, f: dict[str, Any]) -> tuple[Any, ...]:
    t = clean_text
    kw = t(f.get("keyword"))
    return (origin, int(run["id"]), seq, t(run["node"]), _ts(run["started"]), t(run["kind"]), t(run.get("job_id")),
            t(run["verdict"]), t(f["check_id"]), t(f["severity"]), kw.upper() if kw else None, _int(f.get("gpu")),
            t(f.get("action")), t(f.get("message")), t(f.get("remediation")), _evidence(f.get("evidence")))


def drain_params(origin: str, d: dict[str, Any], keyword: Optional[str]) -> tuple[Any, ...]:
    t = clean_text
    return (origin, int(d["id"]), t(d["node"]), _ts(d["ts"]), t(d["op"]), t(d["outcome"]), t(d.get("reason")),
            t(d.get("check_id")), t(keyword), t(d.get("action")), _int(d.get("run_id")), t(d.get("detail")),
            int(d["id"]))


def repeat_params(origin: str, key: tuple[Any, ...], value: tuple[Any, ...]) -> tuple[Any, ...]:
    _table, head_id, head_t = key
    n, last, upto = value
    return (n, _ts(last), upto, origin, head_id, _ts(head_t), upto)


def day_params(origin: str, node: str, start: float, day: dict[str, Any]) -> tuple[Any, ...]:
    from psycopg.types.json import Jsonb  # optional (gpuguard[fleet]): never at import time

    return (_ts(start).date(), origin, clean_text(node), day["runs"], *day["hour_runs"], Jsonb(day["kinds"]),
            _ts(day["first"]), _ts(day["last"]), day["duration_ms_sum"], day["duration_ms_max"], day["upto"])


def execute(cur: Any, origin: str, plan: Statements, store: Any, upto: int) -> int:
    """Run a batch's statements on `cur` (inside the caller's transaction); returns the findings written."""
    if plan.inserts["drains"]:
        cur.executemany(INSERT_DRAIN, plan.inserts["drains"])
    if plan.inserts["runs"]:
        cur.executemany(INSERT_RUN, plan.inserts["runs"])
    if plan.inserts["findings"]:
        cur.executemany(INSERT_FINDING, plan.inserts["findings"])
    for table, sql in (("runs", REPEAT_RUN), ("drains", REPEAT_DRAIN)):
        params = [repeat_params(origin, k, v) for k, v in plan.repeats.items() if k[0] == table]
        if params:
            cur.executemany(sql, params)
        if params and table == "runs":
            cur.executemany(REPEAT_FINDINGS, [(p[0], p[1], p[3], p[4], p[5], p[0]) for p in params])
    days = []
    for node, start in sorted(plan.healthy_days):
        day = store.healthy_day(node, start, upto)
        if day is not None:
            days.append(day_params(origin, node, start, day))
    if days:
        cur.executemany(UPSERT_DAY, days)
    if plan.seen:
        cur.executemany(UPSERT_NODE, [(clean_text(n), _ts(a), _ts(b)) for n, (a, b) in sorted(plan.seen.items())])
    return len(plan.inserts["findings"])
