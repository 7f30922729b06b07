"""One attempt of a requeueable job: what ended it, and what to do next. Pure: facts in, decision out.

How the batch script tells the endings apart (Slurm 22.05, verified on gpuguard's local cluster):
- time limit: `--signal=B:USR1@N` reaches the batch shell first (event "timelimit"); the shell asks the job to
  checkpoint and the step ends. If the grace was too short, Slurm's own TERM arrives with JobState=TIMEOUT.
- node failure: a node of the allocation is DOWN / NOT_RESPONDING / DRAIN / FAIL when the step ends, or srun
  logged "Node failure on <node>". When Slurm itself noticed (slurmd lost), it has already requeued the job
  (Restarts went up) and SIGTERMs the batch shell; otherwise (e.g. a GPU fault drained the node and the ranks
  there crashed) the script requeues it, both times excluding the bad nodes.
- preemption: SIGTERM with PreemptTime set (PreemptMode=REQUEUE: Slurm requeues, Restarts went up).
- a stop request (USR1 long before the time limit, event "stop"): gpuguard monitor's requeue of a hung job
  (its record in <job dir>/gpuguard/events.jsonl: reason "hang", a failure) or a person's
  `scancel --batch --signal=USR1` (reason "manual_stop", a continuation); never "time_limit".
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

torchrun's own reports are parsed in gpuguard.templates.torchrun_report, the job's ExcNodeList is planned in
gpuguard.templates.exclusions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

EVENTS = ("none", "timelimit", "stop", "term", "preflight")
REASONS = ("completed", "time_limit", "preempted", "node_failure", "cancelled", "app_error", "no_retry",
           "requeued_externally", "manual_stop", "lost", "hang", "preflight")
ACTIONS = ("requeued", "finished", "gave_up")
FAILURE_REASONS = frozenset({"app_error", "node_failure", "lost", "hang", "preflight"})
CONTINUATION_REASONS = frozenset({"time_limit", "preempted", "requeued_externally", "manual_stop"})

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
    event: str                        # none | timelimit (USR1 near the limit) | stop (USR1 long before it: the
    #                                   monitor's or an admin's requeue) | term (SIGTERM came) | preflight (it blamed)
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
    blamed: tuple[str, ...] = ()      # event preflight: the nodes `gpuguard preflight` said to go on without


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
    if f.event in ("timelimit", "stop"):
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
    j = _Judgement.of(f, p)
    if f.event == "preflight" and not (f.restarts_now is not None and f.restarts_now > f.restarts_at_start):
        return _preflight_blamed(j)
    return _went_on_without(f, _after_training(j))


def _after_training(j: _Judgement) -> Decision:
    f = j.f
    # Slurm requeued the job itself (a node failure, preemption, an admin): whatever ended the step, the job runs
    # again; the attempt is recorded as that, and the bad nodes are excluded (never gave_up).
    if f.restarts_now is not None and f.restarts_now > f.restarts_at_start:
        return _requeued_by_slurm(j)
    if f.event == "term":
        return _terminated(j)
    if f.event == "timelimit":
        return _time_limit_near(j)
    if f.event == "stop":
        return _stop_requested(j)
    return _step_ended(j)  # event none: the step ended by itself


def _went_on_without(f: AttemptFacts, d: Decision) -> Decision:
    """With min_nodes, a pre-flight that blamed nodes let the training go on without them in this allocation: the
    attempt's ledger line says so, whatever ended it."""
    if not f.blamed:
        return d
    return replace(d, detail=f"{d.detail}; the pre-flight blamed {', '.join(f.blamed)}: this attempt trained "
                             "without them")


@dataclass(frozen=True)
class _Judgement:
    """What `decide` derives from the facts once, and the two budgets an outcome is charged to."""

    f: AttemptFacts
    p: Policy
    sig: Optional[int]
    bad: frozenset[str]
    bad_detail: str
    exclude: tuple[str, ...]
    progress: bool
    failures_before: int
    no_retry_worker: Optional[WorkerExit]
    worker: Optional[WorkerExit]
    rc_fail: int

    @classmethod
    def of(cls, f: AttemptFacts, p: Policy) -> "_Judgement":
        bad = {n for n, info in f.nodes.items() if info.bad} | (node_failures_in_log(f.log_tail) & set(f.nodes))
        bad_detail = ", ".join(f"{n} ({'+'.join(sorted(f.nodes[n].flags & BAD_NODE_FLAGS)) or 'node failure'}"
                               + (f": {f.nodes[n].reason}" if f.nodes[n].reason else "") + ")" for n in sorted(bad))
        progress = f.ckpt_step is not None and (f.budget.best_step is None or f.ckpt_step > f.budget.best_step)
        no_retry_worker = next((w for w in f.workers if w.exit_code in p.no_retry_exit_codes), None)
        worker = no_retry_worker or (f.workers[0] if f.workers else None)
        worker_rc = worker.exit_code if worker and 0 < worker.exit_code < 256 else None
        return cls(f, p, _signal_of(f), frozenset(bad), bad_detail, tuple(sorted(bad)), progress,
                   0 if progress else f.budget.failures, no_retry_worker, worker,
                   worker_rc or (f.exit_code if f.exit_code != 0 else 1))

    def failure(self, reason: str, detail: str, ex: tuple[str, ...] = ()) -> Decision:
        p, n = self.p, self.failures_before + 1
        if n > p.max_failures:
            return Decision(reason, "gave_up", False, ex, f"{detail}; not requeued: {n - 1} failed attempt(s) in a "
                            f"row without checkpoint progress, the maximum is {p.max_failures} (max_failures)",
                            self.rc_fail, self.sig, "failure", self.worker)
        return Decision(reason, "requeued", True, ex, f"{detail}; failure {n} of {p.max_failures} in a row",
                        0, self.sig, "failure", self.worker)

    def continuation(self, reason: str, detail: str) -> Decision:
        f, p = self.f, self.p
        if reason == "time_limit" and f.checkpointing and not self.progress:
            return self.failure(reason, f"{detail}; no new checkpoint during this attempt, so it counts as a failure")
        n = f.budget.continuations + 1
        if n > p.max_continuations:
            return Decision(reason, "gave_up", False, (), f"{detail}; not requeued: the maximum of "
                            f"{p.max_continuations} continuation(s) is reached (max_continuations)", self.rc_fail,
                            self.sig, "continuation", self.worker)
        return Decision(reason, "requeued", True, (), f"{detail}; continuation {n} of {p.max_continuations}", 0,
                        self.sig, "continuation", self.worker)


def _requeued_by_slurm(j: _Judgement) -> Decision:
    if j.bad:
        return Decision("node_failure", "requeued", False, j.exclude,
                        f"Slurm requeued the job after a node failure: {j.bad_detail}", 0, j.sig, "failure")
    if j.f.preempted:
        return Decision("preempted", "requeued", False, (), "preempted; Slurm requeued the job", 0, j.sig,
                        "continuation")
    return Decision("requeued_externally", "requeued", False, (),
                    "Slurm or an admin requeued the job", 0, j.sig, "continuation")


def _preflight_blamed(j: _Judgement) -> Decision:
    """The pre-flight blamed nodes (or a switch's nodes) before the training started: requeue without them, a
    failure like any other (the job's own max_failures), so a fabric that keeps failing cannot loop the job."""
    blamed = tuple(sorted(set(j.f.blamed) & set(j.f.nodes) | j.bad))
    if not blamed:
        return j.failure("preflight", "the pre-flight blamed nodes outside this allocation; requeued as it is")
    return j.failure("preflight", f"the pre-flight before training blamed {', '.join(blamed)}", blamed)


def _terminated(j: _Judgement) -> Decision:
    f = j.f
    if f.job_state == "TIMEOUT":
        return j.continuation("time_limit", "the time limit was reached before the job could checkpoint "
                                            "(requeue_grace_s too short?)")
    if f.preempted:
        return j.continuation("preempted", "preempted (Slurm did not requeue it)")
    if j.bad:
        return j.failure("node_failure", f"node failure: {j.bad_detail}", j.exclude)
    return Decision("cancelled", "gave_up", False, (), f"cancelled (JobState={f.job_state or '?'}); "
                    "a cancelled job is never requeued", f.exit_code or 143, j.sig)


def _time_limit_near(j: _Judgement) -> Decision:
    f = j.f
    if f.exit_code != 0 and j.bad:
        return j.failure("node_failure", f"node failure near the time limit: {j.bad_detail}", j.exclude)
    if f.monitor_requeue:  # the monitor's requeue comes through the same USR1 trap as the time limit
        return j.failure("hang", f"gpuguard monitor requeued a hung job: {f.monitor_requeue}")
    return j.continuation("time_limit", f"time limit near: asked the job to checkpoint; step exit {f.exit_code}"
                          + (f", checkpoint at step {f.ckpt_step}" if f.ckpt_step is not None else ""))


def _stop_requested(j: _Judgement) -> Decision:
    """USR1 reached the batch shell long before the time limit: gpuguard monitor's requeue of a hung job (it left
    its record in the job directory) or a person's `scancel --batch --signal=USR1`: never called the time limit."""
    f = j.f
    if f.exit_code != 0 and j.bad:
        return j.failure("node_failure", f"node failure after a stop request: {j.bad_detail}", j.exclude)
    if f.monitor_requeue:
        return j.failure("hang", f"gpuguard monitor requeued a hung job: {f.monitor_requeue}")
    return j.continuation("manual_stop", "stopped from outside long before the time limit (USR1 to the batch "
                          f"shell, no gpuguard monitor record: an admin's scancel --signal?); step exit {f.exit_code}"
                          + (f", checkpoint at step {f.ckpt_step}" if f.ckpt_step is not None else ""))


def _step_ended(j: _Judgement) -> Decision:
    f, p, sig, worker = j.f, j.p, j.sig, j.worker
    if f.exit_code == 0:
        return Decision("completed", "finished", False, (), "the training step exited 0", 0, sig)
    if j.bad:
        return j.failure("node_failure", f"step exit {f.exit_code} with a bad node: {j.bad_detail}", j.exclude)
    if f.exit_code in p.no_retry_exit_codes:
        return Decision("no_retry", "gave_up", False, (), f"exit code {f.exit_code} is configured as no-retry",
                        f.exit_code, sig, None, worker)
    if j.no_retry_worker:
        nrw = j.no_retry_worker
        return Decision("no_retry", "gave_up", False, (), f"{_worker_label(nrw)}: exit code "
                        f"{nrw.exit_code} is configured as no-retry", nrw.exit_code, sig, None, nrw)
    hit = no_retry_match(f.log_tail, p.no_retry_patterns)
    if hit:
        return Decision("no_retry", "gave_up", False, (), f"{hit[1]}: {hit[0]}", j.rc_fail, sig, None, worker)
    return j.failure("app_error", f"the training step failed with exit {f.exit_code}"
                     + (f"; {_worker_label(worker)}" if worker else ""))
