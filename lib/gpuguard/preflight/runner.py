"""The pre-flight's `measure(groups, stage)` inside an allocation: one `srun` step per group (one task per node,
`--overlap` so that disjoint groups run side by side), a round's steps bounded together by what is left of the
pre-flight's budget. A step that does not finish in time is stopped, never a hung job start; whether it counts as a
hang against its nodes is gpuguard.preflight.judge.round_measurements' call (only beside a run that finished)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Callable, Optional

from gpuguard.nccl.isolate import Group, Measurement
from gpuguard.preflight.judge import Step, round_measurements

ThresholdFn = Callable[[int], Optional[float]]
POLL_S = 0.1


class SrunMeasure:
    def __init__(self, addrs: dict[str, str], threshold_for: ThresholdFn, deadline: float, *,
                 backend: str = "auto", min_bytes: int = 65536, max_bytes: int = 4194304, iters: int = 3,
                 srun: str = "srun", step_cap_s: float = 15.0, min_round_s: float = 3.0) -> None:
        self.addrs = addrs  # node -> address its peers reach it at (NodeAddr)
        self.threshold_for = threshold_for
        self.deadline = deadline  # time.monotonic() by which every round must be over
        self.tail = ["--backend", backend, "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
                     "--iters", str(iters)]
        self.srun = srun
        self.step_cap_s = step_cap_s
        self.min_round_s = min_round_s  # a round with less time left is not started (unknown, not evidence)
        self.port = random.randrange(20000, 40000)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def argv(self, group: Group, timeout_s: float) -> list[str]:
        self.port = self.port + 1 if self.port < 60000 else 20000
        master = f"{self.addrs.get(group[0], group[0])}:{self.port}"
        return [self.srun, "--overlap", "-N", str(len(group)), "-n", str(len(group)), "--ntasks-per-node=1",
                "-w", ",".join(group), "--kill-on-bad-exit=1", "--quiet", sys.executable, "-m",
                "gpuguard.preflight.worker", "--master", master, "--group", ",".join(group), "--timeout", f"{max(1.0, timeout_s):.0f}",
                *self.tail]

    def __call__(self, groups: list[Group], stage: str) -> list[Measurement]:
        if self.left() < self.min_round_s:  # the budget is spent: unknown, never evidence against a node
            return [Measurement(g, stage, self.threshold_for(len(g)), None, error="pre-flight budget spent: not run")
                    for g in groups]
        allowance = min(self.step_cap_s, self.left())
        steps = run_round(groups, [self.argv(g, allowance) for g in groups], allowance)
        return round_measurements(steps, stage, self.threshold_for, allowance, allowance < self.step_cap_s)


def run_round(groups: list[Group], argvs: list[list[str]], allowance_s: float) -> list[Step]:
    """Start every step at once, note when each ends (output to files: no pipe can fill), stop the late ones."""
    files = [tempfile.TemporaryFile("w+") for _ in argvs]
    start = time.monotonic()
    procs = [subprocess.Popen(a, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for a, f in zip(argvs, files)]
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() - start < allowance_s:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - start
        time.sleep(POLL_S)
    late = [p for i, p in enumerate(procs) if i not in ended]
    stop(late)
    steps = []
    for i, (g, p, f) in enumerate(zip(groups, procs, files)):
        steps.append(Step(g, _read(f), p.returncode, i not in ended, ended.get(i, allowance_s)))
    return steps


def stop(procs: "list[subprocess.Popen[str]]") -> None:
    """Late steps get srun's own stop (SIGINT twice), then SIGKILL: all together, a second apart."""
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        until = time.monotonic() + 1.0
        while time.monotonic() < until and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        procs = [p for p in procs if p.poll() is None]
        if not procs:
            return
    for p in procs:
        p.wait()


def _read(f: IO[str]) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text
