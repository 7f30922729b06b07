"""`gpuguard job-attempt begin|end|fabric`: the batch script's bookkeeping, at the I/O edge. Runs as the job's user.

begin: reconciles the ledger (an attempt that vanished without a record, e.g. its batch host died, gets one
now), remembers where this attempt's output starts and which checkpoint it resumes from, and prints that
checkpoint (or nothing).
end: gathers the facts (scontrol show job / node, this attempt's output, torchrun's error files and root-cause
report, the checkpoint now, the budgets earlier attempts used), lets `attempts.decide` judge them, records the
attempt in the job directory's ledger (`attempts.jsonl`) and, if the site configured one, in the user-side store
(`templates.store_path`, an SQLite file with an `attempts` table; never the hooks' store), requeues when
decided, re-evaluates the job's excluded nodes, and prints "<action> <exit code>" for the script.
fabric: waits for every rank's NCCL debug file and reports which network NCCL loaded (gpuguard.templates.fabric).

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

from gpuguard.slurm.parse import node_state_flags, parse_job_line, parse_node_lines
from gpuguard.templates.attempts import (AttemptFacts, Budget, Decision, Excluded, ExclusionPlan, NodeInfo, Policy,
                                         WorkerExit, budget_from_ledger, decide, DEFAULT_NO_RETRY,
                                         fit_exclusions, parse_error_file, parse_torchrun_failures, plan_exclusions,
                                         unschedulable)
from gpuguard.templates.checkpoint import find_checkpoint

LEDGER = "attempts.jsonl"
STATE = "attempt.json"
LOG_TAIL_BYTES = 256 * 1024
ERROR_FILE_MAX_BYTES = 1024 * 1024
ERROR_FILES_MAX = 4096

ATTEMPTS_SCHEMA = ("CREATE TABLE IF NOT EXISTS attempts (id INTEGER PRIMARY KEY, ts REAL NOT NULL, "
                   "job_id TEXT NOT NULL, attempt INTEGER NOT NULL, nodes TEXT, exit_code INTEGER, signal INTEGER, "
                   "reason TEXT, action TEXT, excluded TEXT)")


def _warn(msg: str) -> None:
    print(f"gpuguard job-attempt: {msg}", file=sys.stderr)


def attempt_dir(job_dir: Path, attempt: int) -> Path:
    """Where the batch script keeps one attempt's files (torchrun's error files, NCCL's debug files)."""
    return job_dir / f"attempt-{attempt}"


@dataclass
class Scontrol:
    """Bounded scontrol calls (argv lists, never a shell)."""
    binary: str = "scontrol"
    timeout_s: float = 10.0
    env: Optional[Mapping[str, str]] = None

    def run(self, args: Sequence[str]) -> Optional[str]:
        from gpuguard.util.toolrun import run_tool

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
                                   None if reason in (None, "", "(null)", "None") else reason,
                                   boot_time=f.get("BootTime") or None, slurmd_start=f.get("SlurmdStartTime") or None)
        return infos

    def partition_nodes(self, partition: str) -> list[str]:
        if not partition or partition in ("(null)", "None"):
            return []
        out = self.run(["show", "partition", "-o", partition.split(",")[0]])
        fields = parse_job_line(out) if out else {}
        return self.hostnames(fields.get("Nodes", ""))

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
    from gpuguard.util.fs import atomic_write

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
    """Append the attempt to the user-side store's `attempts` table (a plain SQLite file the job's user owns;
    `gpuguard history` reads it); returns an error text instead of raising. No store configured: None."""
    if not store_path:
        return None
    try:
        import sqlite3

        Path(store_path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(store_path, timeout=5.0)
        try:
            with conn:
                conn.execute(ATTEMPTS_SCHEMA)
                conn.execute("CREATE INDEX IF NOT EXISTS attempts_job ON attempts(job_id, attempt)")
                conn.execute(
                    "INSERT INTO attempts(ts,job_id,attempt,nodes,exit_code,signal,reason,action,excluded) "
                    "VALUES (?,?,?,?,?,?,?,?,?)",
                    (rec["ts"], rec["job_id"], rec["attempt"], rec.get("nodes"), rec.get("exit_code"),
                     rec.get("signal"), rec.get("reason"), rec.get("action"),
                     ",".join(rec.get("excluded") or []) or None))
        finally:
            conn.close()
        return None
    except Exception as e:  # noqa: BLE001 - the ledger file is the primary record; never fail the job for this
        return f"{type(e).__name__}: {e}"


def worker_exits(job_dir: Path, attempt: int, log_tail: str) -> list[WorkerExit]:
    """The failed workers of this attempt: torchrun's error files (TORCHELASTIC_ERROR_FILE of each node's torchrun,
    written when the worker used @record: its message and exit code), then the root causes of torchrun's
    failure reports in the attempt's output (every worker's own exit code, always there)."""
    from dataclasses import replace

    from_files: list[WorkerExit] = []
    adir = attempt_dir(job_dir, attempt)
    try:
        files = sorted(adir.glob("torchrun-node*.json"))[:ERROR_FILES_MAX]
    except OSError:
        files = []
    for path in files:
        try:
            with open(path, "rb") as fh:
                data = json.loads(fh.read(ERROR_FILE_MAX_BYTES).decode("utf-8", errors="replace"))
        except (OSError, ValueError):
            continue
        w = parse_error_file(data, host=path.stem.replace("torchrun-", ""))
        if w:
            from_files.append(w)
    # the report has every root cause's rank, host and real exit code; an error file adds the exception's message
    found: list[WorkerExit] = []
    for r in parse_torchrun_failures(log_tail):
        match = next((w for w in from_files if w.exit_code == r.exit_code), None)
        if match:
            from_files.remove(match)
            r = replace(r, message=match.message, source="error_file")
        found.append(r)
    return found + from_files


# --------------------------------------------------------------------------- context


def user_store_path(cfg: Any, node: str, user: str) -> Optional[str]:
    """`templates.store_path` with {node} and {user} filled in; None when unset or when it names the hooks' own
    store (the root hooks' database must never be writable by users). Pure apart from path normalisation."""
    if cfg is None:
        return None
    raw = (cfg.sections.get("templates") or {}).get("store_path")
    if not raw:
        return None
    path = raw.replace("{node}", node).replace("{user}", user)
    hooks = str(cfg.sections.get("store", {}).get("path") or "").replace("{node}", node)
    if hooks and os.path.normpath(os.path.abspath(path)) == os.path.normpath(os.path.abspath(hooks)):
        _warn(f"templates.store_path ({raw}) is the hooks' own store (store.path): not writing job attempts there "
              "(users must not write the root hooks' database); only the ledger in the job directory is written")
        return None
    return path


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
        user = env.get("SLURM_JOB_USER") or env.get("USER") or str(os.getuid())
        try:
            restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
        except ValueError:
            restarts = 0
        scontrol = Scontrol()
        if cfg is not None:
            # generous: nothing else waits on this but the job itself, and a busy slurmctld answers slowly
            scontrol = Scontrol(cfg.sections["slurm"]["scontrol"], max(10.0, cfg.sections["deadlines"]["scontrol_s"]))
        return cls(job_id=job_id, node=node, nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "",
                   restarts_at_start=restarts, store_path=user_store_path(cfg, node, user), scontrol=scontrol)


def _record(ctx: JobContext, attempt: int, nodes: str, exit_code: Optional[int], sig: Optional[int], event: str,
            reason: str, action: str, excluded: Sequence[str], detail: str, **extra: Any) -> dict[str, Any]:
    return {"ts": round(time.time(), 3), "job_id": ctx.job_id, "attempt": attempt, "nodes": nodes,
            "exit_code": exit_code, "signal": sig, "event": event, "reason": reason, "action": action,
            "excluded": list(excluded), "detail": detail, "batch_host": ctx.node, **extra}


def _persist(ctx: JobContext, job_dir: Path, rec: Mapping[str, Any]) -> None:
    rec = {k: v for k, v in rec.items() if not k.startswith("_")}
    try:
        append_ledger(job_dir, rec)
    except OSError as e:
        _warn(f"cannot append to {job_dir / LEDGER}: {e}")
    err = record_store(ctx.store_path, rec)
    if err:
        _warn(f"attempt not recorded in the job store ({ctx.store_path}): {err}")


@dataclass(frozen=True)
class CheckpointSpec:
    directory: Optional[str] = None
    kind: str = "glob"
    pattern: str = "*"
    marker: Optional[str] = None

    def step(self) -> Optional[int]:
        if not self.directory:
            return None
        try:
            found = find_checkpoint(self.directory, self.kind, self.pattern, self.marker)
        except (OSError, ValueError):
            return None
        return found.step if found else None


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
        infos = ctx.scontrol.nodes(prev_nodes)
        bad = sorted(n for n, info in infos.items() if info.bad)
        reason = "node_failure" if bad else "lost"
        detail = ("the attempt ended without recording itself (batch host failure or SIGKILL); Slurm requeued "
                  "the job" + (f"; now bad: {', '.join(bad)}" if bad else ""))
        _persist(ctx, job_dir, _record(ctx, prev["attempt"], prev.get("nodes", ""), None, None, "lost", reason,
                                       "requeued", bad, detail, budget="failure",
                                       excluded_boot={n: infos[n].boot_time for n in bad}))
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
                                    "resume_step": resume.step if resume else None,
                                    "resume_why": resume.why if resume else None})
    return str(resume.path) if resume else ""


def _ours(ledger: Sequence[Mapping[str, Any]]) -> dict[str, Excluded]:
    """Nodes gpuguard added to ExcNodeList in earlier attempts (the latest record of each wins)."""
    ours: dict[str, Excluded] = {}
    for r in ledger:
        boots = r.get("excluded_boot") if isinstance(r.get("excluded_boot"), dict) else {}
        flagged = r.get("excluded_flagged") if isinstance(r.get("excluded_flagged"), dict) else {}
        for n in r.get("excluded") or []:
            if isinstance(n, str):
                ours[n] = Excluded(boot_time=boots.get(n), flagged=bool(flagged.get(n, True)))
        for n in r.get("unexcluded") or []:
            ours.pop(n, None)
    return ours


def end(ctx: JobContext, job_dir: Path, attempt: int, exit_code: int, event: str, policy: Policy,
        checkpoint: CheckpointSpec = CheckpointSpec(), keep_excluded: Sequence[str] = ()) -> Decision:
    """End of an attempt: judge, record, act. Returns the decision (already carried out). The caller ignores SIGTERM
    around it (`ignore_term`): `scontrol requeue` makes slurmstepd SIGTERM everything in the batch step."""
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        state = json.loads((job_dir / STATE).read_text())
        if not isinstance(state, dict) or state.get("attempt") != attempt:
            state = {}
    except (OSError, ValueError):
        state = {}
    ledger = read_ledger(job_dir)
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
    log_tail = read_log_since(state.get("log") or job.get("StdOut"), int(state.get("log_offset") or 0))
    workers = worker_exits(job_dir, attempt, log_tail)
    ckpt_step = checkpoint.step()
    facts = AttemptFacts(
        attempt=attempt, exit_code=exit_code, event=event, restarts_at_start=ctx.restarts_at_start,
        restarts_now=restarts_now, job_state=job.get("JobState"),
        preempted=bool(preempt and preempt not in ("None", "Unknown")) or "preempt" in job.get("Reason", "").lower(),
        nodes=nodes, log_tail=log_tail, monitor_requeue=monitor_requeue_since(job_dir, state.get("started")),
        budget=budget_from_ledger(ledger, attempt), checkpointing=bool(checkpoint.directory), ckpt_step=ckpt_step,
        workers=tuple(workers))
    decision = decide(facts, policy)
    if decision.action == "gave_up":
        # the job's real state, read again just before recording: Slurm may have requeued it meanwhile
        facts, decision = _slurm_requeued_since(ctx, facts, policy, decision)
    return _record_and_act(ctx, job_dir, job, ledger, nodes, facts, policy, decision, state, attempt, event,
                           exit_code, ckpt_step, keep_excluded)


def _slurm_requeued_since(ctx: JobContext, facts: AttemptFacts, policy: Policy,
                          decision: Decision) -> tuple[AttemptFacts, Decision]:
    """Facts and decision again if `scontrol show job` now says Slurm requeued the job (Restarts went up)."""
    from dataclasses import replace

    fresh = ctx.scontrol.job(ctx.job_id)
    try:
        restarts = int(fresh["Restarts"])
    except (KeyError, ValueError):
        return facts, decision
    if restarts <= ctx.restarts_at_start:
        return facts, decision
    facts = replace(facts, restarts_now=restarts, job_state=fresh.get("JobState"))
    again = decide(facts, policy)
    return facts, replace(again, detail=again.detail + "; Slurm had already requeued the job (read again before "
                                                       "recording)")


def _record_and_act(ctx: JobContext, job_dir: Path, job: Mapping[str, str], ledger: Sequence[Mapping[str, Any]],
                    nodes: Mapping[str, NodeInfo], facts: AttemptFacts, policy: Policy, decision: Decision,
                    state: Mapping[str, Any], attempt: int, event: str, exit_code: int, ckpt_step: Optional[int],
                    keep_excluded: Sequence[str]) -> Decision:
    w = decision.worker
    extra: dict[str, Any] = dict(
        duration_s=round(time.time() - state["started"], 1) if state.get("started") else None,
        resumed_from=state.get("resume"), ckpt_step=ckpt_step, budget=decision.budget,
        worker_exit_code=w.exit_code if w else None, worker_rank=w.rank if w else None,
        worker_host=w.host if w else None, worker_exit_source=w.source if w else None,
        worker_error=w.message if w else None)
    if decision.exclude:
        extra["excluded_boot"] = {n: nodes[n].boot_time for n in decision.exclude if n in nodes}
        extra["excluded_flagged"] = {n: nodes[n].bad for n in decision.exclude if n in nodes}
    fabric = _fabric_summary(job_dir, attempt)
    if fabric:
        extra["fabric"] = fabric
    rec = _record(ctx, attempt, ctx.nodelist, exit_code, decision.signal, event, decision.reason, decision.action,
                  decision.exclude, decision.detail, **extra)
    plan = None
    if decision.action == "requeued":
        plan = _plan_exclusions(ctx, job, ledger, decision, nodes, keep_excluded, rec)
    # record first: after `scontrol requeue` only KillWait seconds are left before SIGKILL
    _persist(ctx, job_dir, rec)
    if decision.requeue and not ctx.scontrol.requeue(ctx.job_id):
        facts2, again = _slurm_requeued_since(ctx, facts, policy, decision)
        if again.action == "requeued" and not again.requeue:
            # refused because Slurm's own requeue (a node failure) came first: a requeue all the same
            return _record_and_act(ctx, job_dir, ctx.scontrol.job(ctx.job_id), ledger, nodes, facts2, policy,
                                   again, state, attempt, event, exit_code, ckpt_step, keep_excluded)
        fix = dict(rec, ts=round(time.time(), 3), action="gave_up",
                   detail=decision.detail + "; scontrol requeue failed (see the job output): the job ends here")
        for k in ("exclusions", "unexcluded", "warning"):
            fix.pop(k, None)
        _persist(ctx, job_dir, fix)
        return Decision(decision.reason, "gave_up", False, decision.exclude, fix["detail"],
                        decision.exit_code or 1, decision.signal, decision.budget, decision.worker)
    if plan is not None and sorted(plan.exclude) != sorted(rec.get("_current_exclusions", [])):
        # ExcNodeList can only change once the job is no longer running, i.e. after the requeue; it is not
        # eligible to start again before this (Slurm waits out EligibleTime), so the next attempt sees it.
        if not ctx.scontrol.exclude(ctx.job_id, plan.exclude):
            _warn(f"could not set ExcNodeList={','.join(plan.exclude)} on the requeued job")
        elif plan.dropped:
            _warn(f"no longer excluding {','.join(plan.dropped)}: healthy again")
    return decision


def _plan_exclusions(ctx: JobContext, job: Mapping[str, str], ledger: Sequence[Mapping[str, Any]],
                     decision: Decision, nodes: Mapping[str, NodeInfo], keep_excluded: Sequence[str],
                     rec: dict[str, Any]) -> Any:
    """Re-evaluate ExcNodeList for the next attempt (nodes gpuguard excluded earlier and healthy again are
    dropped) and warn when the job can no longer be scheduled. Adds what it decided to `rec`."""
    current = ctx.scontrol.hostnames(job.get("ExcNodeList", ""))
    ours = _ours(ledger)
    static = ctx.scontrol.hostnames(",".join(keep_excluded)) if keep_excluded else []
    earlier = [n for n in current if n in ours and n not in nodes]
    infos = dict(nodes)
    infos.update(ctx.scontrol.nodes(earlier))
    plan = plan_exclusions(current, static, ours, infos, decision.exclude)
    rec["_current_exclusions"] = current
    try:
        needed = int(job.get("NumNodes", "0").split("-")[0])
    except ValueError:
        needed = 0
    partition = ctx.scontrol.partition_nodes(job.get("Partition", "")) if plan.exclude else []
    order = [n for n in ours if n in plan.exclude] + [n for n in decision.exclude if n not in ours]
    fitted, room = fit_exclusions(plan, needed, partition, static, order)
    if room:
        plan = ExclusionPlan(fitted, tuple(sorted(plan.dropped + room)), tuple(n for n in plan.kept if n not in room))
        states = "; ".join(f"{n} is {'+'.join(sorted(infos[n].flags)) or 'unknown'}" for n in room if n in infos)
        note = (f"not excluding {', '.join(room)}: with it excluded the partition has too few nodes for the job "
                f"({needed} needed of {len(partition)}), which would then pend forever; "
                + (f"{states}: " if states else "") + "Slurm does not use a drained or down node, so the job "
                "starts once it is back")
        rec["exclusion_note"] = note
        print(f"gpuguard: {note}", file=sys.stderr)
    if plan.dropped:
        rec["unexcluded"] = list(plan.dropped)
    rec["exclusions"] = list(plan.exclude)
    warning = unschedulable(needed, partition, plan.exclude) if plan.exclude else None
    if warning:
        rec["warning"] = warning
        print(f"gpuguard: WARNING {warning}", file=sys.stderr)
    return plan


def _fabric_summary(job_dir: Path, attempt: int) -> Optional[dict[str, Any]]:
    try:
        from gpuguard.templates.fabric import read_attempt, summary

        inits = read_attempt(attempt_dir(job_dir, attempt) / "nccl")
    except Exception as e:  # noqa: BLE001 - a summary is a nicety; never fail the bookkeeping for it
        _warn(f"NCCL debug files not read: {e}")
        return None
    return summary(inits) if inits else None


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


def ignore_term() -> None:
    """For the `job-attempt end` process, for the rest of its life: `scontrol requeue` makes slurmstepd SIGTERM
    everything in the batch step, this process included, and the attempt must be recorded and its outcome printed
    first (SIGKILL follows only after KillWait). Never done inside `end()`: a process-wide disposition that callers
    (and their children, which inherit an ignored signal) did not ask for."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def notify_outcome(cfg: Any, ctx: JobContext, job_dir: Path, attempt: int, decision: Decision) -> Optional[str]:
    """Tell the site's receivers when a job gives up: after a hang the last they heard was the monitor's "requeue
    requested". Nothing for a job that finished, was requeued or was cancelled by a person. Returns emit's
    answer (None: nothing to say). Never raises."""
    if cfg is None or decision.action != "gave_up" or decision.reason == "cancelled":
        return None
    try:
        from gpuguard.notify import Event, emit, user_state_path

        event = Event(kind="gave_up", node=ctx.node, job_id=ctx.job_id, scope="job", check_id=decision.reason,
                      severity="critical", message=f"job {ctx.job_id} gave up after attempt {attempt} "
                                                    f"({decision.reason}): {decision.detail}",
                      evidence={"ledger": str(job_dir / LEDGER), "exit_code": decision.exit_code})
        # generous: nothing waits on this but the job's own end (the batch script gives job-attempt end 120 s)
        return emit(cfg, event, budget_s=20.0, state_path=user_state_path(cfg, str(job_dir), ctx.job_id, ctx.node))
    except Exception as e:  # noqa: BLE001 - the decision stands; a message that could not go out is logged
        _warn(f"could not notify that the job gave up: {type(e).__name__}: {e}")
        return None


def policy_from_args(max_failures: int, codes: Sequence[int], patterns: Sequence[str],
                     max_continuations: int = 50) -> Policy:
    extra = tuple((p, f"matches the job's no-retry pattern {p!r}") for p in patterns)
    return Policy(max_failures=max_failures, max_continuations=max_continuations,
                  no_retry_exit_codes=tuple(codes), no_retry_patterns=DEFAULT_NO_RETRY + extra)


def state_dict(decision: Decision) -> dict[str, Any]:
    return asdict(decision)


__all__ = ["Budget", "CheckpointSpec", "JobContext", "Scontrol", "begin", "end", "policy_from_args",
           "read_ledger", "user_store_path", "worker_exits"]
