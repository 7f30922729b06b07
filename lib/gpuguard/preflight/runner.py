"""The pre-flight's `measure(groups, stage)` inside an allocation: one `srun` step per group (one task per node,
`--overlap` so that disjoint groups run side by side), each bounded by what is left of the pre-flight's budget. A
step that does not finish in time is stopped: a hang is a result (gpuguard.preflight.judge), never a hung job start."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from gpuguard.nccl.isolate import Group, Measurement
from gpuguard.preflight.judge import measurement

ThresholdFn = Callable[[int], Optional[float]]


class SrunMeasure:
    def __init__(self, addrs: dict[str, str], threshold_for: ThresholdFn, deadline: float, *,
                 backend: str = "auto", min_bytes: int = 65536, max_bytes: int = 4194304, iters: int = 3,
                 srun: str = "srun", step_cap_s: float = 15.0) -> None:
        self.addrs = addrs  # node -> address its peers reach it at (NodeAddr)
        self.threshold_for = threshold_for
        self.deadline = deadline  # time.monotonic() by which everything must be done
        self.tail = ["--backend", backend, "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
                     "--iters", str(iters)]
        self.srun = srun
        self.step_cap_s = step_cap_s
        self.port = random.randrange(20000, 40000)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def argv(self, group: Group, timeout_s: float) -> list[str]:
        self.port = self.port + 1 if self.port < 60000 else 20000
        master = f"{self.addrs.get(group[0], group[0])}:{self.port}"
        return [self.srun, "--overlap", "-N", str(len(group)), "-n", str(len(group)), "--ntasks-per-node=1",
                "-w", ",".join(group), "--kill-on-bad-exit=1", "--quiet", sys.executable, "-m",
                "gpuguard.preflight.worker", "--master", master, "--timeout", f"{max(1.0, timeout_s):.0f}",
                *self.tail]

    def __call__(self, groups: list[Group], stage: str) -> list[Measurement]:
        if self.left() < 2.0:  # the budget is spent: unknown, never evidence against a node
            return [Measurement(g, stage, self.threshold_for(len(g)), None, error="pre-flight budget spent")
                    for g in groups]
        timeout = min(self.step_cap_s, self.left())
        start = time.monotonic()
        procs = [subprocess.Popen(self.argv(g, timeout), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True) for g in groups]
        out: list[Measurement] = []
        for g, p in zip(groups, procs):
            text, timed_out = _wait(p, start + timeout)
            out.append(measurement(g, stage, threshold=self.threshold_for(len(g)), output=text, rc=p.returncode,
                                   timed_out=timed_out, duration_s=time.monotonic() - start))
        return out


def _wait(p: "subprocess.Popen[str]", until: float) -> tuple[str, bool]:
    """(output, timed out): a step past its time gets srun's own stop (SIGINT twice), then SIGKILL."""
    try:
        text, _ = p.communicate(timeout=max(0.05, until - time.monotonic()))
        return text or "", False
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            text, _ = p.communicate(timeout=1.0)
            return text or "", True
        except subprocess.TimeoutExpired:
            continue
    text, _ = p.communicate()
    return text or "", True
