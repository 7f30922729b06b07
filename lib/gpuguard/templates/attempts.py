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
- application error: the step failed with none of the above. Retried while requeues remain, unless the exit code
  is a configured no-retry code or the attempt's output shows an error that would happen again (SyntaxError,
  missing module, bad arguments, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

EVENTS = ("none", "timelimit", "term")
REASONS = ("completed", "time_limit", "preempted", "node_failure", "cancelled", "app_error", "no_retry",
           "requeued_externally", "lost")
ACTIONS = ("requeued", "finished", "gave_up")

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
))
_NODE_FAILURE_LOG = re.compile(r"(?:srun: error: Node failure on|NODE_FAIL on node|Node failure on) ([A-Za-z0-9_.\-\[\],]+)")


@dataclass(frozen=True)
class NodeInfo:
    name: str
    flags: frozenset[str]
    reason: Optional[str] = None

    @property
    def bad(self) -> bool:
        return bool(self.flags & BAD_NODE_FLAGS)


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


@dataclass(frozen=True)
class Policy:
    max_requeues: int = 3
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


def _signal_of(f: AttemptFacts) -> Optional[int]:
    if f.event == "timelimit":
        return 10  # SIGUSR1
    if f.event == "term":
        return 15
    return f.exit_code - 128 if f.exit_code > 128 else None


def decide(f: AttemptFacts, p: Policy) -> Decision:
    if f.event not in EVENTS:
        raise ValueError(f"event must be one of {', '.join(EVENTS)}, got {f.event!r}")
    sig = _signal_of(f)
    bad = {n for n, info in f.nodes.items() if info.bad} | (node_failures_in_log(f.log_tail) & set(f.nodes))
    bad_detail = ", ".join(f"{n} ({'+'.join(sorted(f.nodes[n].flags & BAD_NODE_FLAGS)) or 'node failure'}"
                           + (f": {f.nodes[n].reason}" if f.nodes[n].reason else "") + ")" for n in sorted(bad))
    exclude = tuple(sorted(bad))
    left = p.max_requeues - (f.attempt - 1)  # requeues still allowed
    rc_fail = f.exit_code if f.exit_code != 0 else 1

    def requeue(reason: str, detail: str, ex: tuple[str, ...] = ()) -> Decision:
        if left <= 0:
            return Decision(reason, "gave_up", False, ex, f"{detail}; not requeued: the maximum of "
                            f"{p.max_requeues} requeue(s) is reached", rc_fail, sig)
        return Decision(reason, "requeued", True, ex, f"{detail}; requeue {f.attempt} of {p.max_requeues}", 0, sig)

    if f.event == "term":
        slurm_requeued = f.restarts_now is not None and f.restarts_now > f.restarts_at_start
        if slurm_requeued:
            if bad:
                return Decision("node_failure", "requeued", False, exclude,
                                f"Slurm requeued the job after a node failure: {bad_detail}", 0, sig)
            if f.preempted:
                return Decision("preempted", "requeued", False, (), "preempted; Slurm requeued the job", 0, sig)
            return Decision("requeued_externally", "requeued", False, (),
                            "Slurm or an admin requeued the job", 0, sig)
        if f.job_state == "TIMEOUT":
            return requeue("time_limit", "the time limit was reached before the job could checkpoint "
                                         "(requeue_grace_s too short?)")
        if f.preempted:
            return requeue("preempted", "preempted (Slurm did not requeue it)")
        if bad:
            return requeue("node_failure", f"node failure: {bad_detail}", exclude)
        return Decision("cancelled", "gave_up", False, (), f"cancelled (JobState={f.job_state or '?'}); "
                        "a cancelled job is never requeued", f.exit_code or 143, sig)

    if f.event == "timelimit":
        if f.exit_code != 0 and bad:
            return requeue("node_failure", f"node failure near the time limit: {bad_detail}", exclude)
        if f.monitor_requeue:  # the monitor's requeue comes through the same USR1 trap as the time limit
            return requeue("hang", f"gpuguard monitor requeued a hung job: {f.monitor_requeue}")
        return requeue("time_limit", f"time limit near: asked the job to checkpoint; step exit {f.exit_code}")

    # event none: the step ended by itself
    if f.exit_code == 0:
        return Decision("completed", "finished", False, (), "the training step exited 0", 0, sig)
    if bad:
        return requeue("node_failure", f"step exit {f.exit_code} with a bad node: {bad_detail}", exclude)
    if f.exit_code in p.no_retry_exit_codes:
        return Decision("no_retry", "gave_up", False, (), f"exit code {f.exit_code} is configured as no-retry",
                        f.exit_code, sig)
    hit = no_retry_match(f.log_tail, p.no_retry_patterns)
    if hit:
        return Decision("no_retry", "gave_up", False, (), f"{hit[1]}: {hit[0]}", f.exit_code, sig)
    return requeue("app_error", f"the training step failed with exit {f.exit_code}")
