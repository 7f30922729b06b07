"""The run's deadline and its stages' shares of it.

A hook has one deadline (`deadlines.<kind>_s`); slurmd kills a hook that overruns its own limits. The stages
share it so that a slow one cannot starve the one after it: gathering (NVML, the kernel log, tools) may use the
deadline only up to what acting on the verdict needs (`scontrol` to drain: `deadlines.scontrol_s`) and recording
it, so a health check whose NVML hangs still drains its node within its own deadline.
"""

from __future__ import annotations

import time

RECORD_RESERVE_S = 0.5  # SQLite write, the verdict journal, metrics: milliseconds, with room for a slow disk


class Deadline:
    def __init__(self, seconds: float, now: float | None = None) -> None:
        self.start = time.monotonic() if now is None else now
        self.end = self.start + seconds

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def bound(self, seconds: float) -> float:
        """`seconds`, cut to what is left (never zero: a zero timeout means "no timeout" to some callees)."""
        return max(0.01, min(seconds, self.remaining()))


class StageBudget:
    """One run's deadline split into stages: gather until `gather_end`, then act and record in the reserve."""

    def __init__(self, total_s: float, scontrol_s: float) -> None:
        self.total = Deadline(total_s)
        # act: reading the node's state and draining it are two scontrol calls sharing one scontrol_s budget;
        # never more than half the run, so a short deadline still leaves gathering most of it
        self.act_reserve_s = min(scontrol_s + 0.5, total_s / 2)
        self.gather = Deadline(max(0.5, total_s - self.act_reserve_s - RECORD_RESERVE_S), now=self.total.start)

    def remaining(self) -> float:
        return self.total.remaining()

    def act_bound(self, seconds: float) -> float:
        """A Slurm call's timeout in the act stage: its configured bound, within the run's deadline minus the
        record reserve."""
        return max(0.01, min(seconds, self.total.remaining() - RECORD_RESERVE_S))
