"""`gpuguard job-attempt begin|end`: the batch script's bookkeeping, at the I/O edge.

begin: reconciles the ledger (an attempt that vanished without a record, e.g. its batch host died, gets one
now), remembers where this attempt's output starts, and prints the checkpoint to resume from (or nothing).
end: gathers the facts (scontrol show job / node, this attempt's output), lets `attempts.decide` judge them,
records the attempt in the job directory's ledger (`attempts.jsonl`) and in the history store (`attempts`
table), then requeues (excluding failed nodes) when decided, and prints "<action> <exit code>" for the script.

Every scontrol call is an argv list with a timeout. Nothing here may hang or crash a job: a failing store or
scontrol is reported on stderr and the decision still stands.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from gpuguard.slurm import node_state_flags, parse_job_line, parse_node_lines
from gpuguard.templates.attempts import AttemptFacts, Decision, NodeInfo, Policy, decide, DEFAULT_NO_RETRY
from gpuguard.templates.checkpoint import find_checkpoint

LEDGER = "attempts.jsonl"
STATE = "attempt.json"
LOG_TAIL_BYTES = 256 * 1024

ATTEMPTS_SCHEMA = ("CREATE TABLE IF NOT EXISTS attempts (id INTEGER PRIMARY KEY, ts REAL NOT NULL, "
                   "job_id TEXT NOT NULL, attempt INTEGER NOT NULL, nodes TEXT, exit_code INTEGER, signal INTEGER, "
                   "reason TEXT, action TEXT, excluded TEXT)")


def _warn(msg: str) -> None:
    print(f"gpuguard job-attempt: {msg}", file=sys.stderr)


@dataclass
class Scontrol:
    """Bounded scontrol calls (argv lists, never a shell)."""
    binary: str = "scontrol"
    timeout_s: float = 10.0
    env: Optional[Mapping[str, str]] = None

    def run(self, args: Sequence[str]) -> Optional[str]:
        from gpuguard.tools import run_tool

        r = run_tool([self.binary, *args], self.timeout_s, env=self.env)
        if r.rc is None:
            _warn(f"scontrol {' '.join(args)}: {r.error}")
            return None
        if r.rc != 0:
            _warn(f"scontrol {' '.join(args)} failed ({r.rc}): {r.err_text().strip()[:300]}")
            return None
        return r.text()

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run(["show", "job", "-o", job_id])
        return parse_job_line(out) if out else {}

    def hostnames(self, nodelist: str) -> list[str]:
        if not nodelist or nodelist in ("(null)", "None"):
            return []
        out = self.run(["show", "hostnames", nodelist])
        return [h for h in (out or "").split() if h]

    def nodes(self, names: Sequence[str]) -> dict[str, NodeInfo]:
        if not names:
            return {}
        out = self.run(["show", "node", "-o", ",".join(names)])
        infos: dict[str, NodeInfo] = {}
        for name, f in parse_node_lines(out or "").items():
            reason = f.get("Reason")
            infos[name] = NodeInfo(name, frozenset(node_state_flags(f.get("State", ""))),
                                   None if reason in (None, "", "(null)", "None") else reason)
        return infos

    def requeue(self, job_id: str) -> bool:
        return self.run(["requeue", job_id]) is not None

    def exclude(self, job_id: str, nodes: Sequence[str]) -> bool:
        return self.run(["update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"]) is not None


# --------------------------------------------------------------------------- files


def read_ledger(job_dir: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = (job_dir / LEDGER).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line from a killed writer: skip it, keep the rest
        if isinstance(rec, dict):
            out.append(rec)
    return out


def append_ledger(job_dir: Path, record: Mapping[str, Any]) -> None:
    line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
    fd = os.open(job_dir / LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write with O_APPEND: lines from concurrent writers never interleave
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    from gpuguard.fsutil import atomic_write

    atomic_write(path, json.dumps(data, default=str))


def read_log_since(path: Optional[str], offset: int, limit: int = LOG_TAIL_BYTES) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(offset, size - limit) if offset <= size else max(0, size - limit))
            return fh.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def record_store(store_path: Optional[str], rec: Mapping[str, Any]) -> Optional[str]:
    """Append the attempt to the history store's `attempts` table; returns an error text instead of raising."""
    if not store_path:
        return "no store configured"
    try:
        from gpuguard.store import Store

        with Store(store_path, timeout_s=5.0) as st:
            st.conn.execute(ATTEMPTS_SCHEMA)
            st.conn.execute("CREATE INDEX IF NOT EXISTS attempts_job ON attempts(job_id, attempt)")
            st.conn.execute(
                "INSERT INTO attempts(ts,job_id,attempt,nodes,exit_code,signal,reason,action,excluded) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                (rec["ts"], rec["job_id"], rec["attempt"], rec.get("nodes"), rec.get("exit_code"), rec.get("signal"),
                 rec.get("reason"), rec.get("action"), ",".join(rec.get("excluded") or []) or None))
        return None
    except Exception as e:  # noqa: BLE001 - the ledger file is the primary record; never fail the job for this
        return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- context


@dataclass
class JobContext:
    job_id: str
    node: str
    nodelist: str
    restarts_at_start: int
    store_path: Optional[str] = None
    scontrol: Scontrol = field(default_factory=Scontrol)

    @classmethod
    def from_env(cls, env: Mapping[str, str], cfg: Any = None) -> "JobContext":
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
        if not job_id:
            raise ValueError("job-attempt runs inside a Slurm batch job: SLURM_JOB_ID is not set")
        node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        try:
            restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
        except ValueError:
            restarts = 0
        store_path = None
        scontrol = Scontrol()
        if cfg is not None:
            tpl = cfg.sections.get("templates", {})
            store_path = (tpl.get("store_path") or cfg.sections["store"]["path"]).replace("{node}", node)
            # generous: nothing else waits on this but the job itself, and a busy slurmctld answers slowly
            scontrol = Scontrol(cfg.sections["slurm"]["scontrol"], max(10.0, cfg.sections["deadlines"]["scontrol_s"]))
        return cls(job_id=job_id, node=node, nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "",
                   restarts_at_start=restarts, store_path=store_path, scontrol=scontrol)


def _record(ctx: JobContext, attempt: int, nodes: str, exit_code: Optional[int], sig: Optional[int], event: str,
            reason: str, action: str, excluded: Sequence[str], detail: str, **extra: Any) -> dict[str, Any]:
    return {"ts": round(time.time(), 3), "job_id": ctx.job_id, "attempt": attempt, "nodes": nodes,
            "exit_code": exit_code, "signal": sig, "event": event, "reason": reason, "action": action,
            "excluded": list(excluded), "detail": detail, "batch_host": ctx.node, **extra}


def _persist(ctx: JobContext, job_dir: Path, rec: Mapping[str, Any]) -> None:
    try:
        append_ledger(job_dir, rec)
    except OSError as e:
        _warn(f"cannot append to {job_dir / LEDGER}: {e}")
    err = record_store(ctx.store_path, rec)
    if err:
        _warn(f"attempt not recorded in the history store ({ctx.store_path}): {err}")


# --------------------------------------------------------------------------- begin / end


def begin(ctx: JobContext, job_dir: Path, attempt: int, checkpoint_dir: Optional[str] = None,
          checkpoint_kind: str = "glob", checkpoint_glob: str = "*", checkpoint_marker: Optional[str] = None) -> str:
    """Start of an attempt. Returns the checkpoint path to resume from ("" for none)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    state_path = job_dir / STATE
    try:
        prev = json.loads(state_path.read_text())
    except (OSError, ValueError):
        prev = {}
    recorded = {int(r.get("attempt", 0)) for r in read_ledger(job_dir)}
    if isinstance(prev, dict) and isinstance(prev.get("attempt"), int) and prev["attempt"] < attempt \
            and prev["attempt"] not in recorded:
        # The previous attempt never recorded its end: its batch host died or it was SIGKILLed. Slurm requeued it.
        prev_nodes = ctx.scontrol.hostnames(prev.get("nodes", ""))
        bad = sorted(n for n, info in ctx.scontrol.nodes(prev_nodes).items() if info.bad)
        reason = "node_failure" if bad else "lost"
        detail = ("the attempt ended without recording itself (batch host failure or SIGKILL); Slurm requeued "
                  "the job" + (f"; now bad: {', '.join(bad)}" if bad else ""))
        _persist(ctx, job_dir, _record(ctx, prev["attempt"], prev.get("nodes", ""), None, None, "lost", reason,
                                       "requeued", bad, detail))
    job = ctx.scontrol.job(ctx.job_id)
    log_path = job.get("StdOut")
    try:
        offset = os.path.getsize(log_path) if log_path else 0
    except OSError:
        offset = 0
    resume = find_checkpoint(checkpoint_dir, checkpoint_kind, checkpoint_glob, checkpoint_marker) \
        if checkpoint_dir else None
    _write_json_atomic(state_path, {"attempt": attempt, "started": time.time(), "nodes": ctx.nodelist,
                                    "restarts_at_start": ctx.restarts_at_start, "log": log_path,
                                    "log_offset": offset, "resume": str(resume.path) if resume else None,
                                    "resume_why": resume.why if resume else None})
    return str(resume.path) if resume else ""


def end(ctx: JobContext, job_dir: Path, attempt: int, exit_code: int, event: str, policy: Policy) -> Decision:
    """End of an attempt: judge, record, act. Returns the decision (already carried out)."""
    # `scontrol requeue` makes slurmstepd SIGTERM everything in the batch step, this process included: finish
    # recording first (SIGKILL follows only after KillWait).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        state = json.loads((job_dir / STATE).read_text())
        if not isinstance(state, dict) or state.get("attempt") != attempt:
            state = {}
    except (OSError, ValueError):
        state = {}
    job = ctx.scontrol.job(ctx.job_id)
    names = ctx.scontrol.hostnames(ctx.nodelist)
    nodes = ctx.scontrol.nodes(names)
    for n in names:
        nodes.setdefault(n, NodeInfo(n, frozenset()))
    try:
        restarts_now: Optional[int] = int(job["Restarts"]) if "Restarts" in job else None
    except ValueError:
        restarts_now = None
    preempt = job.get("PreemptTime")
    facts = AttemptFacts(
        attempt=attempt, exit_code=exit_code, event=event, restarts_at_start=ctx.restarts_at_start,
        restarts_now=restarts_now, job_state=job.get("JobState"),
        preempted=bool(preempt and preempt not in ("None", "Unknown")) or "preempt" in job.get("Reason", "").lower(),
        nodes=nodes, log_tail=read_log_since(state.get("log") or job.get("StdOut"), int(state.get("log_offset") or 0)),
        monitor_requeue=monitor_requeue_since(job_dir, state.get("started")))
    decision = decide(facts, policy)
    excluded: list[str] = []
    if decision.exclude:
        existing = ctx.scontrol.hostnames(job.get("ExcNodeList", ""))
        excluded = sorted(set(existing) | set(decision.exclude))
    rec = _record(ctx, attempt, ctx.nodelist, exit_code, decision.signal, event, decision.reason, decision.action,
                  decision.exclude, decision.detail,
                  duration_s=round(time.time() - state["started"], 1) if state.get("started") else None,
                  resumed_from=state.get("resume"))
    _persist(ctx, job_dir, rec)
    if decision.requeue:
        if not ctx.scontrol.requeue(ctx.job_id):
            fix = _record(ctx, attempt, ctx.nodelist, exit_code, decision.signal, event, decision.reason, "gave_up",
                          decision.exclude, "scontrol requeue failed (see the job output); the job ends here")
            _persist(ctx, job_dir, fix)
            return Decision(decision.reason, "gave_up", False, decision.exclude, fix["detail"],
                            exit_code or 1, decision.signal)
    if excluded and decision.action == "requeued":
        # Only possible once the job is no longer running, i.e. after the requeue; it is not eligible to start
        # again before this (Slurm waits out EligibleTime), so the next attempt avoids these nodes.
        if not ctx.scontrol.exclude(ctx.job_id, excluded):
            _warn(f"could not exclude {','.join(excluded)} from the requeued job")
    return decision


def monitor_requeue_since(job_dir: Path, since: Optional[float]) -> Optional[str]:
    """The latest requeue `gpuguard monitor` asked for during this attempt (it records its events in
    <job dir>/gpuguard/events.jsonl), as "check: detail"; None when there was none."""
    found = None
    try:
        with open(job_dir / "gpuguard" / "events.jsonl", errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict) and ev.get("kind") == "requeue" and ev.get("ok") and \
                        (since is None or float(ev.get("ts") or 0) >= float(since)):
                    found = f"{ev.get('check') or 'hang'} on {ev.get('node') or '?'}"
    except OSError:
        return None
    return found


def policy_from_args(max_requeues: int, codes: Sequence[int], patterns: Sequence[str]) -> Policy:
    extra = tuple((p, f"matches the job's no-retry pattern {p!r}") for p in patterns)
    return Policy(max_requeues=max_requeues, no_retry_exit_codes=tuple(codes),
                  no_retry_patterns=DEFAULT_NO_RETRY + extra)


def state_dict(decision: Decision) -> dict[str, Any]:
    return asdict(decision)
