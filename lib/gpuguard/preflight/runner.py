"""The pre-flight's `measure(groups, stage)` inside an allocation: each round is sent to the persistent workers
(gpuguard.preflight.pool: one per node, torch imported once), or with `nccl.preflight_backend: nccl-tests` run as
one srun step of nccl-tests per group (gpuguard.preflight.nccltests: no workers, none late), bounded by what is left of the pre-flight's budget. A
collective that does not finish in time is stopped, never a hung job start; whether it counts as a hang against its
nodes is gpuguard.preflight.judge.round_measurements' call (only beside a run that finished in a fraction of that
time).

The budget: the workers' start-up (torch's import: seconds of CPU, the largest cost on a busy CPU node) may use up to
`startup_share` of it; the first all-node round gets at most half of what is then left (its result decides whether
anything else runs at all); the blame rounds share the rest and are cut short by the pool's early stop. A worker that
is not up once the others have long been is evidence (a hang before its collective: a wedged driver, a stuck
import); one not up when the budget's start-up share ran out with the others only just up is not: the machine was too
busy to judge (`TOO_SLOW`)."""

from __future__ import annotations

import time
from typing import Callable, Optional

from gpuguard.nccl.isolate import Group, Measurement
from gpuguard.preflight.judge import HANG_MARGIN, NO_FLOOR, TOO_SLOW, round_measurements
from gpuguard.preflight.nccltests import NcclTestsRounds
from gpuguard.preflight.pool import WorkerPool

ThresholdFn = Callable[[int], Optional[float]]


class PoolMeasure:
    def __init__(self, pool: "WorkerPool | NcclTestsRounds", threshold_for: ThresholdFn, deadline: float, *, backend: str = "gloo",
                 min_bytes: int = 65536, max_bytes: int = 4194304, iters: int = 3, step_cap_s: float = 15.0,
                 min_round_s: float = 2.0) -> None:
        self.pool = pool
        self.threshold_for = threshold_for
        self.deadline = deadline  # time.monotonic() by which every round must be over
        self.job = {"backend": backend, "min_bytes": min_bytes, "max_bytes": max_bytes, "iters": iters}
        self.step_cap_s = step_cap_s
        self.min_round_s = min_round_s  # a round with less time left is not started (unknown, not evidence)
        self.late = late_verdicts(pool)
        self.rounds: list[tuple[str, float]] = []  # (stage, seconds) for the record
        self.quickest: dict[int, float] = {}  # group size -> the quickest run with a result so far (seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def thr(self, g: Group) -> float:
        t = self.threshold_for(len(g))
        return t if t is not None else NO_FLOOR

    def __call__(self, groups: list[Group], stage: str) -> list[Measurement]:
        if self.left() < self.min_round_s:  # the budget is spent: unknown, never evidence against a node
            return [Measurement(g, stage, self.thr(g), None, error=f"{TOO_SLOW}: the pre-flight's budget ran out")
                    for g in groups]
        first = not self.rounds
        allowance = min(self.step_cap_s, self.left() * (0.5 if first else 1.0))
        allowance = max(allowance, min(self.min_round_s, self.left()))
        out: dict[int, Measurement] = {}
        runnable = []
        up = set(self.pool.up())  # a worker late at the start that came up since runs like any other
        for i, g in enumerate(groups):
            late = [self.late[n] for n in g if n in self.late and n not in up]
            if late:
                hung = [why for evidence, why in late if evidence]
                out[i] = Measurement(g, stage, self.thr(g), 0.0 if hung else None,
                                     error=(hung or [why for _, why in late])[0])
            else:
                runnable.append(i)
        t0 = time.monotonic()
        if runnable:
            steps = self.pool.run_round([groups[i] for i in runnable], allowance,
                                        {**self.job, "timeout": max(2.0, allowance)}, self.quickest)
            ms = round_measurements(steps, stage, self.threshold_for, allowance, allowance < self.step_cap_s,
                                    self.quickest)
            out.update(zip(runnable, ms))
            for st in steps:
                if st.rc == 0 and not st.timed_out:
                    n = len(st.group)
                    self.quickest[n] = min(self.quickest.get(n, st.duration_s), st.duration_s)
        self.rounds.append((stage, time.monotonic() - t0))
        return [out[i] for i in range(len(groups))]


def late_verdicts(pool: "WorkerPool | NcclTestsRounds") -> dict[str, tuple[bool, str]]:
    """node -> (evidence?, why) for each worker not up when the start-up wait ended (gone ones are the pool's:
    their groups fail at once, as a failed launch)."""
    ups = [w.up_s for w in pool.workers.values() if w.up_s is not None]
    waited = pool.waited_s()
    out = {}
    for n, w in pool.workers.items():
        if w.sock is not None or w.gone:
            continue
        if ups and max(ups) <= waited * HANG_MARGIN:
            out[n] = (True, f"hung: its worker not up within {waited:.1f}s, the others' in {max(ups):.1f}s")
        else:
            out[n] = (False, f"{TOO_SLOW}: its worker not up after {waited:.1f}s (the machine is loaded)")
    return out
