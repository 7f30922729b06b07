"""One attempt of a requeueable job: what ended it, and what to do next. Pure: facts in, decision out.

How the batch script tells the endings apart (Slurm 22.05, verified on gpuguard's local cluster):
- time limit: `--signal=B:USR1@N` reaches the batch shell first (event "timelimit"); the shell asks the job to
  checkpoint and the step ends. If the grace was too short, Slurm's own TERM arrives with JobState=TIMEOUT.
- node failure: a node of the allocation is DOWN / NOT_RESPONDING / DRAIN / FAIL when the step ends, or srun
  logged "Node failure on <node>". When Slurm itself noticed (slurmd lost), it has already requeued the job
  (Restarts went up) and SIGTERMs the batch shell; otherwise (e.g. a GPU fault drained the node and the ranks
  there crashed) the script requeues it, both times excluding the bad nodes.
- preemption: SIGTERM with PreemptTime set (PreemptMode=REQUEUE: Slurm requeues, Restarts went up).
- cancellation (scancel): SIGTERM, Restarts unchanged, no preemption, no bad node: never requeued.
- application error: the step failed with none of the above. Retried while the failure budget lasts, unless an
  exit code is a configured no-retry code (the step's, or the worker's own code recovered from torchrun's error
  file or its "Root Cause" report: torchrun itself always exits 1) or the attempt's output shows an error that
  would happen again (SyntaxError, missing module, bad arguments, ...).

Two budgets, counted from the job's ledger (NeMo-Run and submitit count the same way):
- failures (errors, node failures, hangs, lost attempts) in a row: `max_failures`; the count starts again whenever
  the checkpoint advanced. A time limit that did not advance a configured checkpoint also counts as a failure
  (a job that never gets anywhere must not loop forever).
- continuations (time limit, preemption, a requeue by Slurm or an admin): `max_continuations`. They never use up
  the failure budget. Prolog requeues never reach the batch script and count for neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

EVENTS = ("none", "timelimit", "term")
REASONS = ("completed", "time_limit", "preempted", "node_failure", "cancelled", "app_error", "no_retry",
           "requeued_externally", "lost", "hang")
ACTIONS = ("requeued", "finished", "gave_up")
FAILURE_REASONS = frozenset({"app_error", "node_failure", "lost", "hang"})
CONTINUATION_REASONS = frozenset({"time_limit", "preempted", "requeued_externally"})

# Node state flags under which the node must not get the job again.
BAD_NODE_FLAGS = frozenset({"DOWN", "DRAIN", "FAIL", "FAILING", "NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN",
                            "POWERING_DOWN", "REBOOT_REQUESTED", "REBOOT_ISSUED", "INVALID_REG"})

# Errors that running the same code again cannot fix. Matched on whole lines of the attempt's output, at the
# start of the line (after srun's "N: " label or torchrun's "[rankN]:" prefix), where Python prints the final
# line of a traceback, so a library *warning* that mentions ImportError does not count.
_LINE_PREFIX = r"^(?:\d+: )?(?:\[(?:rank|default)\d*\]: ?)?"
DEFAULT_NO_RETRY: tuple[tuple[str, str], ...] = tuple((_LINE_PREFIX + p, why) for p, why in (
    (r"SyntaxError: ", "a SyntaxError fails the same way on every attempt"),
    (r"(IndentationError|TabError): ", "an indentation error fails the same way on every attempt"),
    (r"ModuleNotFoundError: ", "a missing Python module is not fixed by running again"),
    (r"ImportError: ", "an import error is not fixed by running again"),
    (r"(\S+: )?error: (unrecognized arguments|the following arguments are required|argument )",
     "the command line is wrong (argparse usage error)"),
    (r"\S*python\S*: can't open file ", "the training script does not exist"),
    (r"torchrun: error: ", "torchrun's own arguments are wrong"),
    (r"gpuguard: \S+: checkpoint_dir .* is not visible inside the container",
     "checkpoint_dir is not mounted in the container: every attempt would restart from step 0"),
))
_NODE_FAILURE_LOG = re.compile(r"(?:srun: error: Node failure on|NODE_FAIL on node|Node failure on) ([A-Za-z0-9_.\-\[\],]+)")


@dataclass(frozen=True)
class NodeInfo:
    name: str
    flags: frozenset[str]
    reason: Optional[str] = None
    boot_time: Optional[str] = None       # scontrol's BootTime
    slurmd_start: Optional[str] = None    # scontrol's SlurmdStartTime

    @property
    def bad(self) -> bool:
        return bool(self.flags & BAD_NODE_FLAGS)


@dataclass(frozen=True)
class WorkerExit:
    """A training process that failed, as torchrun reported it."""
    exit_code: int                 # the process's own exit code; negative: killed by that signal
    rank: Optional[int] = None     # global rank
    host: Optional[str] = None
    source: str = "torchrun_report"  # error_file (TORCHELASTIC_ERROR_FILE) | torchrun_report (its stderr)
    message: Optional[str] = None  # the exception, when the worker used torchrun's @record


@dataclass(frozen=True)
class Budget:
    """What the job's earlier attempts used (from its ledger)."""
    failures: int = 0              # failed attempts requeued since the checkpoint last advanced
    continuations: int = 0         # time-limit / preemption requeues so far
    best_step: Optional[int] = None  # the highest checkpoint step any earlier attempt ended with


@dataclass(frozen=True)
class AttemptFacts:
    attempt: int                      # 1-based: SLURM_RESTART_COUNT + 1
    exit_code: int                    # of the training step (srun)
    event: str                        # none | timelimit (USR1 came) | term (SIGTERM came)
    restarts_at_start: int = 0        # SLURM_RESTART_COUNT when this attempt started
    restarts_now: Optional[int] = None  # scontrol's Restarts now (None: unknown)
    job_state: Optional[str] = None   # scontrol's JobState now
    preempted: bool = False           # PreemptTime set (or Reason says so)
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    log_tail: str = ""                # this attempt's part of the job output
    monitor_requeue: Optional[str] = None  # gpuguard monitor asked for this requeue (a hang): what it saw
    budget: Budget = field(default_factory=Budget)
    checkpointing: bool = False       # the job names a checkpoint directory
    ckpt_step: Optional[int] = None   # the newest complete checkpoint's step when the attempt ended
    workers: tuple[WorkerExit, ...] = ()  # failed workers torchrun reported


@dataclass(frozen=True)
class Policy:
    max_failures: int = 3
    max_continuations: int = 50
    no_retry_exit_codes: tuple[int, ...] = ()
    no_retry_patterns: tuple[tuple[str, str], ...] = DEFAULT_NO_RETRY


@dataclass(frozen=True)
class Decision:
    reason: str
    action: str                  # requeued | finished | gave_up
    requeue: bool                # the script must `scontrol requeue` (False when Slurm already did, or no requeue)
    exclude: tuple[str, ...]     # nodes to add to the job's ExcNodeList
    detail: str
    exit_code: int               # what the batch script exits with
    signal: Optional[int] = None
    budget: Optional[str] = None  # failure | continuation: which budget this requeue used (None: neither)
    worker: Optional[WorkerExit] = None  # the failed worker the decision is about


def node_failures_in_log(text: str) -> set[str]:
    return {m.group(1).rstrip(",") for m in _NODE_FAILURE_LOG.finditer(text)}


def no_retry_match(text: str, patterns: Sequence[tuple[str, str]]) -> Optional[tuple[str, str]]:
    """(the matching output line, why) for the first no-retry error in `text`, else None."""
    compiled = [(re.compile(p), why) for p, why in patterns]
    for line in text.splitlines():
        for rx, why in compiled:
            if rx.search(line):
                return line.strip()[:300], why
    return None


# torchrun's ChildFailedError report (torch/distributed/elastic/multiprocessing/errors/__init__.py, the
# _FAILURE_FORMAT_TEMPLATE): "Root Cause (first observed failure):" then "[0]:", "  host : ...",
# "  rank : 1 (local_rank: 1)", "  exitcode : 3 (pid: 1234)". Lines may carry srun's "N: " label.
_LABEL = r"^(?:\d+: )?"
_ROOT_CAUSE = re.compile(_LABEL + r"Root Cause \(first observed failure\):\s*$")
_REPORT_FIELD = re.compile(_LABEL + r"\s+(time|host|rank|exitcode|error_file|traceback)\s*: ?(.*?)\s*$")


def parse_torchrun_failures(text: str) -> list[WorkerExit]:
    """The root causes in torchrun's failure reports in `text` (one per torchrun that failed), in order."""
    out: list[WorkerExit] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not _ROOT_CAUSE.match(lines[i]):
            i += 1
            continue
        fields: dict[str, str] = {}
        j = i + 1
        while j < len(lines) and j <= i + 12:
            m = _REPORT_FIELD.match(lines[j])
            if m:
                fields.setdefault(m.group(1), m.group(2))
            elif fields and not re.match(_LABEL + r"\[\d+\]:\s*$", lines[j]):
                break
            j += 1
        code = re.match(r"(-?\d+)", fields.get("exitcode", ""))
        if code:
            rank = re.match(r"(\d+)", fields.get("rank", ""))
            out.append(WorkerExit(exit_code=int(code.group(1)), rank=int(rank.group(1)) if rank else None,
                                  host=fields.get("host") or None, source="torchrun_report"))
        i = j
    return out


def parse_error_file(data: object, host: Optional[str] = None) -> Optional[WorkerExit]:
    """torchrun's error file (TORCHELASTIC_ERROR_FILE of the torchrun process): the failed worker's own report,
    {"message": {"message": "RuntimeError: ...", "extraInfo": {...}, "errorCode": 3}}, written when the worker
    used torch.distributed.elastic's @record (errorCode: its exit code; absent for an exception, i.e. 1)."""
    if not isinstance(data, dict):
        return None
    msg = data.get("message")
    if isinstance(msg, dict):
        code = msg.get("errorCode")
        text = msg.get("message")
    else:
        code, text = data.get("errorCode"), msg
    if isinstance(code, bool) or not isinstance(code, int):
        code = 1 if text else None
    if code is None:
        return None
    return WorkerExit(exit_code=code, host=host, source="error_file",
                      message=str(text).strip().splitlines()[-1][:300] if text else None)


def budget_from_ledger(records: Sequence[Mapping[str, object]], before_attempt: int) -> Budget:
    """The budgets attempts before `before_attempt` used. Pure."""
    best: Optional[int] = None
    failures = continuations = 0
    last: dict[int, Mapping[str, object]] = {}
    for r in records:  # ledger order: a later record of the same attempt (e.g. requeue failed) supersedes
        if _int(r.get("attempt")) < before_attempt:
            last[_int(r.get("attempt"))] = r
    for _attempt, r in sorted(last.items()):
        step = r.get("ckpt_step")
        if isinstance(step, int) and not isinstance(step, bool) and (best is None or step > best):
            best = step
            failures = 0  # progress: the failure count starts again
        if r.get("action") != "requeued":
            continue
        kind = r.get("budget") or ("failure" if r.get("reason") in FAILURE_REASONS else
                                   "continuation" if r.get("reason") in CONTINUATION_REASONS else None)
        if kind == "failure":
            failures += 1
        elif kind == "continuation":
            continuations += 1
    return Budget(failures=failures, continuations=continuations, best_step=best)


def _int(v: object) -> int:
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0


def _signal_of(f: AttemptFacts) -> Optional[int]:
    if f.event == "timelimit":
        return 10  # SIGUSR1
    if f.event == "term":
        return 15
    return f.exit_code - 128 if f.exit_code > 128 else None


def _worker_label(w: WorkerExit) -> str:
    who = f"rank {w.rank}" if w.rank is not None else "a worker"
    where = f" on {w.host}" if w.host else ""
    what = f"killed by signal {-w.exit_code}" if w.exit_code < 0 else f"exited with code {w.exit_code}"
    how = "torchrun's error file" if w.source == "error_file" else "torchrun's root-cause report"
    return f"{who}{where} {what} ({how}" + (f": {w.message}" if w.message else "") + ")"


def decide(f: AttemptFacts, p: Policy) -> Decision:
    if f.event not in EVENTS:
        raise ValueError(f"event must be one of {', '.join(EVENTS)}, got {f.event!r}")
    sig = _signal_of(f)
    bad = {n for n, info in f.nodes.items() if info.bad} | (node_failures_in_log(f.log_tail) & set(f.nodes))
    bad_detail = ", ".join(f"{n} ({'+'.join(sorted(f.nodes[n].flags & BAD_NODE_FLAGS)) or 'node failure'}"
                           + (f": {f.nodes[n].reason}" if f.nodes[n].reason else "") + ")" for n in sorted(bad))
    exclude = tuple(sorted(bad))
    progress = f.ckpt_step is not None and (f.budget.best_step is None or f.ckpt_step > f.budget.best_step)
    failures_before = 0 if progress else f.budget.failures
    no_retry_worker = next((w for w in f.workers if w.exit_code in p.no_retry_exit_codes), None)
    worker = no_retry_worker or (f.workers[0] if f.workers else None)
    worker_rc = worker.exit_code if worker and 0 < worker.exit_code < 256 else None
    rc_fail = worker_rc or (f.exit_code if f.exit_code != 0 else 1)

    def failure(reason: str, detail: str, ex: tuple[str, ...] = ()) -> Decision:
        n = failures_before + 1
        if n > p.max_failures:
            return Decision(reason, "gave_up", False, ex, f"{detail}; not requeued: {n - 1} failed attempt(s) in a "
                            f"row without checkpoint progress, the maximum is {p.max_failures} (max_failures)",
                            rc_fail, sig, "failure", worker)
        return Decision(reason, "requeued", True, ex, f"{detail}; failure {n} of {p.max_failures} in a row",
                        0, sig, "failure", worker)

    def continuation(reason: str, detail: str) -> Decision:
        if reason == "time_limit" and f.checkpointing and not progress:
            return failure(reason, f"{detail}; no new checkpoint during this attempt, so it counts as a failure")
        n = f.budget.continuations + 1
        if n > p.max_continuations:
            return Decision(reason, "gave_up", False, (), f"{detail}; not requeued: the maximum of "
                            f"{p.max_continuations} continuation(s) is reached (max_continuations)", rc_fail, sig,
                            "continuation", worker)
        return Decision(reason, "requeued", True, (), f"{detail}; continuation {n} of {p.max_continuations}", 0,
                        sig, "continuation", worker)

    # Slurm requeued the job itself (a node failure, preemption, an admin): whatever ended the step, the job runs
    # again; the attempt is recorded as that, and the bad nodes are excluded (never gave_up).
    if f.restarts_now is not None and f.restarts_now > f.restarts_at_start:
        if bad:
            return Decision("node_failure", "requeued", False, exclude,
                            f"Slurm requeued the job after a node failure: {bad_detail}", 0, sig, "failure")
        if f.preempted:
            return Decision("preempted", "requeued", False, (), "preempted; Slurm requeued the job", 0, sig,
                            "continuation")
        return Decision("requeued_externally", "requeued", False, (),
                        "Slurm or an admin requeued the job", 0, sig, "continuation")

    if f.event == "term":
        if f.job_state == "TIMEOUT":
            return continuation("time_limit", "the time limit was reached before the job could checkpoint "
                                              "(requeue_grace_s too short?)")
        if f.preempted:
            return continuation("preempted", "preempted (Slurm did not requeue it)")
        if bad:
            return failure("node_failure", f"node failure: {bad_detail}", exclude)
        return Decision("cancelled", "gave_up", False, (), f"cancelled (JobState={f.job_state or '?'}); "
                        "a cancelled job is never requeued", f.exit_code or 143, sig)

    if f.event == "timelimit":
        if f.exit_code != 0 and bad:
            return failure("node_failure", f"node failure near the time limit: {bad_detail}", exclude)
        if f.monitor_requeue:  # the monitor's requeue comes through the same USR1 trap as the time limit
            return failure("hang", f"gpuguard monitor requeued a hung job: {f.monitor_requeue}")
        return continuation("time_limit", f"time limit near: asked the job to checkpoint; step exit {f.exit_code}"
                            + (f", checkpoint at step {f.ckpt_step}" if f.ckpt_step is not None else ""))

    # event none: the step ended by itself
    if f.exit_code == 0:
        return Decision("completed", "finished", False, (), "the training step exited 0", 0, sig)
    if bad:
        return failure("node_failure", f"step exit {f.exit_code} with a bad node: {bad_detail}", exclude)
    if f.exit_code in p.no_retry_exit_codes:
        return Decision("no_retry", "gave_up", False, (), f"exit code {f.exit_code} is configured as no-retry",
                        f.exit_code, sig, None, worker)
    if no_retry_worker:
        return Decision("no_retry", "gave_up", False, (), f"{_worker_label(no_retry_worker)}: exit code "
                        f"{no_retry_worker.exit_code} is configured as no-retry", no_retry_worker.exit_code, sig,
                        None, no_retry_worker)
    hit = no_retry_match(f.log_tail, p.no_retry_patterns)
    if hit:
        return Decision("no_retry", "gave_up", False, (), f"{hit[1]}: {hit[0]}", rc_fail, sig, None, worker)
    return failure("app_error", f"the training step failed with exit {f.exit_code}"
                   + (f"; {_worker_label(worker)}" if worker else ""))


# --------------------------------------------------------------------------- exclusions


@dataclass(frozen=True)
class Excluded:
    """A node gpuguard added to the job's ExcNodeList after a failure (from the ledger)."""
    boot_time: Optional[str] = None  # its BootTime then
    flagged: bool = True             # Slurm showed it DOWN/DRAIN/...; False: only srun's log said it failed


@dataclass(frozen=True)
class ExclusionPlan:
    exclude: tuple[str, ...]       # the job's ExcNodeList from now on
    dropped: tuple[str, ...]       # nodes gpuguard excluded earlier that are healthy again
    kept: tuple[str, ...]          # nodes gpuguard excluded earlier that are still bad


def plan_exclusions(current: Sequence[str], static: Sequence[str], ours: Mapping[str, Excluded],
                    nodes: Mapping[str, NodeInfo], new_bad: Sequence[str]) -> ExclusionPlan:
    """Re-evaluate the job's ExcNodeList at a requeue. `current`: what Slurm has now; `static`: the job's own
    exclude (kept forever); `ours`: nodes gpuguard excluded after earlier failures; `nodes`: their state now;
    `new_bad`: nodes this attempt found bad. A node gpuguard excluded is dropped once Slurm no longer shows it
    DOWN/DRAIN/FAIL/... (an admin or gpuguard's health check put it back), and, when it was excluded on srun's
    word alone, once it booted again. Nodes someone else put in the list are kept. Pure."""
    keep: set[str] = set(static) | set(new_bad)
    dropped: list[str] = []
    kept: list[str] = []
    for n in current:
        if n in keep:
            continue
        if n not in ours:
            keep.add(n)  # an admin's, or from before gpuguard: not ours to drop
            continue
        info = nodes.get(n)
        if info is None or info.bad or (not ours[n].flagged and (info.boot_time is None
                                                                 or info.boot_time == ours[n].boot_time)):
            keep.add(n)
            kept.append(n)
        else:
            dropped.append(n)
    return ExclusionPlan(tuple(sorted(keep)), tuple(sorted(dropped)), tuple(sorted(kept)))


def fit_exclusions(plan: ExclusionPlan, needed: int, partition: Sequence[str], static: Sequence[str],
                   oldest_first: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the ExcNodeList to set, gpuguard's exclusions dropped to make room). A job whose exclusions leave its
    partition fewer nodes than it needs pends forever (BadConstraints), even once the excluded nodes are healthy
    again, and nothing re-evaluates a pending job. So gpuguard's own exclusions (never the job's `exclude` or an
    admin's) are dropped, oldest first, until the job fits: a node still drained or down is not used by Slurm
    anyway, and the job starts on it once it is back. If dropping all of them does not help, nothing is dropped
    (`unschedulable` then warns). Pure."""
    if not partition or needed <= 0:
        return plan.exclude, ()
    exclude = list(plan.exclude)
    dropped: list[str] = []

    def usable() -> int:
        return sum(1 for n in partition if n not in exclude)

    for n in oldest_first:
        if usable() >= needed:
            break
        if n in exclude and n not in static and n in partition:
            exclude.remove(n)
            dropped.append(n)
    if usable() < needed or not dropped:
        return plan.exclude, ()
    return tuple(sorted(exclude)), tuple(dropped)


def unschedulable(needed: int, partition_nodes: Sequence[str], excluded: Sequence[str]) -> Optional[str]:
    """A warning when the partition has fewer nodes than the job needs once ExcNodeList is applied. Pure."""
    if not partition_nodes or needed <= 0:
        return None
    usable = [n for n in partition_nodes if n not in set(excluded)]
    if len(usable) >= needed:
        return None
    return (f"the job needs {needed} node(s) but only {len(usable)} of the partition's {len(partition_nodes)} are "
            f"not excluded (ExcNodeList={','.join(excluded) or '(none)'}): it will pend (Reason=BadConstraints or "
            "Resources) until excluded nodes are dropped (`scontrol update JobId=<id> ExcNodeList=...`) or the "
            "partition grows")
