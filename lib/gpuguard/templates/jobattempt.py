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

The job directory's files are read and written by gpuguard.templates.jobfiles, scontrol is called through
gpuguard.templates.jobslurm, and gpuguard.templates.attempts judges.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from gpuguard.notify import Event, emit, user_state_path
from gpuguard.templates.attempts import (DEFAULT_NO_RETRY, AttemptFacts, Decision, NodeInfo, Policy,
                                         budget_from_ledger, decide)
from gpuguard.templates.checkpoint import find_checkpoint
from gpuguard.templates.exclusions import (Excluded, ExclusionPlan, fit_exclusions, nodes_needed, plan_exclusions,
                                           unschedulable)
from gpuguard.templates.jobfiles import (LEDGER, STATE, append_ledger, fabric_summary, monitor_requeue_since,
                                         read_ledger, read_log_since, record_store, user_store_path, warn,
                                         worker_exits, write_json_atomic)
from gpuguard.templates.jobslurm import Scontrol


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
            scontrol = Scontrol(cfg.slurm.scontrol, max(10.0, cfg.deadlines.scontrol_s))
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
        warn(f"cannot append to {job_dir / LEDGER}: {e}")
    err = record_store(ctx.store_path, rec)
    if err:
        warn(f"attempt not recorded in the job store ({ctx.store_path}): {err}")


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
    write_json_atomic(state_path, {"attempt": attempt, "started": time.time(), "nodes": ctx.nodelist,
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
        checkpoint: CheckpointSpec = CheckpointSpec(), keep_excluded: Sequence[str] = (),
        blamed: Sequence[str] = ()) -> Decision:
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
        workers=tuple(workers), blamed=tuple(blamed))
    decision = decide(facts, policy)
    if decision.action == "gave_up":
        # the job's real state, read again just before recording: Slurm may have requeued it meanwhile
        facts, decision = _slurm_requeued_since(ctx, facts, policy, decision)
    return _record_and_act(ctx, job_dir, job, ledger, nodes, facts, policy, decision, state, attempt, event,
                           exit_code, ckpt_step, keep_excluded)


def slurm_requeued(ctx: JobContext) -> bool:
    """Whether Slurm has requeued the job since this attempt started (its Restarts went up)."""
    try:
        return int(ctx.scontrol.job(ctx.job_id)["Restarts"]) > ctx.restarts_at_start
    except (KeyError, ValueError):
        return False


def _slurm_requeued_since(ctx: JobContext, facts: AttemptFacts, policy: Policy,
                          decision: Decision) -> tuple[AttemptFacts, Decision]:
    """Facts and decision again if `scontrol show job` now says Slurm requeued the job (Restarts went up)."""
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
    fabric = fabric_summary(job_dir, attempt)
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
            warn(f"could not set ExcNodeList={','.join(plan.exclude)} on the requeued job")
        elif healthy := [n for n in plan.dropped if n not in rec.get("_room", ())]:
            warn(f"no longer excluding {','.join(healthy)}: healthy again")
    if plan is not None:  # what is said from here on is what was set: not a node dropped to let the job fit
        return replace(decision, exclude=tuple(n for n in decision.exclude if n in plan.exclude))
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
    needed = nodes_needed(job.get("NumNodes", ""), len(nodes))
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
        rec["_room"] = room
        print(f"gpuguard: {note}", file=sys.stderr)
    if plan.dropped:
        rec["unexcluded"] = list(plan.dropped)
    rec["exclusions"] = list(plan.exclude)
    warning = unschedulable(needed, partition, plan.exclude) if plan.exclude else None
    if warning:
        rec["warning"] = warning
        print(f"gpuguard: WARNING {warning}", file=sys.stderr)
    return plan


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
        event = Event(kind="gave_up", node=ctx.node, job_id=ctx.job_id, scope="job", check_id=decision.reason,
                      severity="critical", message=f"job {ctx.job_id} gave up after attempt {attempt} "
                                                    f"({decision.reason}): {decision.detail}",
                      evidence={"ledger": str(job_dir / LEDGER), "exit_code": decision.exit_code})
        # generous: nothing waits on this but the job's own end (the batch script gives job-attempt end 120 s)
        return emit(cfg, event, budget_s=20.0, state_path=user_state_path(cfg, str(job_dir), ctx.job_id, ctx.node))
    except Exception as e:  # noqa: BLE001 - the decision stands; a message that could not go out is logged
        warn(f"could not notify that the job gave up: {type(e).__name__}: {e}")
        return None


def policy_from_args(max_failures: int, codes: Sequence[int], patterns: Sequence[str],
                     max_continuations: int = 50) -> Policy:
    extra = tuple((p, f"matches the job's no-retry pattern {p!r}") for p in patterns)
    return Policy(max_failures=max_failures, max_continuations=max_continuations,
                  no_retry_exit_codes=tuple(codes), no_retry_patterns=DEFAULT_NO_RETRY + extra)


def state_dict(decision: Decision) -> dict[str, Any]:
    return asdict(decision)
