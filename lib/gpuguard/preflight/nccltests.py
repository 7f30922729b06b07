"""The pre-flight's rounds with nccl-tests (`nccl.preflight_backend: nccl-tests`): every group of a round is one
`srun` step of the same `all_reduce_perf` the fleet sweep runs (gpuguard.nccl.sweep.nccl_tests_argv: the sweep's
binary, GPUs per node and MPI plugin), with the pre-flight's sizes and iterations. No torch worker is started.

A step's output is read with the sweep's parser (gpuguard.nccl.parse.parse_nccl) and turned into the tagged result
line the torch workers answer with (gpuguard.preflight.judge.result_line), so judging, blame and the floor are the
same on both paths. The round ends as the pool's does (gpuguard.preflight.pool.late_after): when every step has
ended, when the allowance is spent, or once a group of the same size has its result and the rest are late; a step
still running then is stopped (srun's own stop, then SIGKILL of its process group). Each step also carries
`srun --time` (whole minutes, Slurm's granularity) so that Slurm ends it should this process die first. The steps
run with the NCCL environment preset added (gpuguard.preflight.ncclenv: what the templates give their ranks); srun
passes the environment on to every rank."""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, Optional

from gpuguard.nccl.isolate import Group
from gpuguard.nccl.parse import parse_nccl
from gpuguard.nccl.result import NcclRow
from gpuguard.nccl.sweep import JobSpec, nccl_tests_argv
from gpuguard.preflight.judge import Step, result_line
from gpuguard.preflight.pool import POLL_S, Run, late_after, stop
from gpuguard.preflight.protocol import SIZE_FACTOR

BACKEND = "nccl-tests"


def step_argv(spec: JobSpec, group: Group, job: dict[str, Any], allowance_s: float, srun: str = "srun"
              ) -> list[str]:
    """One group's srun step: one rank per GPU on exactly the group's nodes, inside the allocation (--overlap),
    `--time` the allowance rounded up to whole minutes (Slurm's backstop; the round stops it on time). Pure."""
    minutes = max(1, math.ceil(allowance_s / 60.0))
    return [srun, "--overlap", f"--nodes={len(group)}", f"--ntasks={len(group) * spec.gpus_per_node}",
            f"--ntasks-per-node={spec.gpus_per_node}", f"--nodelist={','.join(group)}", f"--mpi={spec.mpi}",
            f"--time={minutes}", "--kill-on-bad-exit=1", "--quiet",
            *nccl_tests_argv(spec, int(job["min_bytes"]), int(job["max_bytes"]), SIZE_FACTOR, int(job["iters"]))]


# nccl-tests prints bandwidths as %6.2f: below this a printed busbw has fewer than three significant digits (a link
# at 20 Mbit/s prints 0.00), and the time column (at least four) gives it instead
PRINTED_PRECISION_GBPS = 1.0


def row_busbw(row: NcclRow, world: int) -> float:
    """A row's out-of-place bus bandwidth, from its time column where the printed figure is too coarse: nccl-tests'
    own all_reduce formula, size / time * 2 (n - 1) / n over its `world` ranks. Pure."""
    printed = float(row.busbw or 0.0)
    t = row.oop_time_us if row.oop_busbw is not None else row.ip_time_us
    if printed >= PRINTED_PRECISION_GBPS or not t or t <= 0 or world < 2:
        return printed
    return row.size_bytes / t / 1e3 * 2.0 * (world - 1) / world


def step_result(output: str, world: int) -> tuple[Optional[str], str]:
    """(the tagged result line, "") from an nccl-tests run's output, or (None, why not). Pure. Wrong values make
    the run a failure (evidence), as a collective that returned garbage is no measurement."""
    res = parse_nccl(output)
    rows = [r for r in res.rows if r.busbw is not None]
    if not rows:
        errs = res.errors or [ln for ln in output.splitlines() if ln.strip()][-1:] or ["no output"]
        return None, f"no result table: {errs[-1][:160]}"
    wrong = res.wrong_total or res.out_of_bounds or 0
    if wrong:
        return None, f"all_reduce returned {int(wrong)} wrong values"
    return result_line([r.size_bytes for r in rows], [row_busbw(r, world) for r in rows], BACKEND, world), ""


@dataclass
class _Proc:
    run: Run
    proc: "Optional[subprocess.Popen[bytes]]"
    out: Optional[IO[bytes]]
    rc: Optional[int] = None
    text: str = ""


@dataclass
class NcclTestsRounds:
    """`run_round` as gpuguard.preflight.pool.WorkerPool's, with an srun step of nccl-tests per group. There are no
    workers to wait for: every node is up, none is late."""
    nodes: list[str]
    spec: JobSpec
    srun: str = "srun"
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment for every step
    workers: dict[str, Any] = field(default_factory=dict)

    def up(self) -> list[str]:
        return list(self.nodes)

    def waited_s(self) -> float:
        return 0.0

    def close(self) -> None:
        """Nothing outlives a round."""

    def run_round(self, groups: list[Group], allowance_s: float, job: dict[str, Any],
                  quickest: Optional[dict[int, float]] = None) -> list[Step]:
        t0 = time.monotonic()
        procs = []
        env = {**os.environ, **self.env}
        for i, g in enumerate(groups):
            out = tempfile.TemporaryFile()
            try:
                p = subprocess.Popen(step_argv(self.spec, g, job, allowance_s, self.srun), stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            except OSError as e:
                out.close()
                run = Run(g, f"s{i}", t0, error=f"cannot run {self.srun}: {e.strerror or e}", ended_s=0.0)
                procs.append(_Proc(run, None, None, rc=127, text=run.error))
                continue
            procs.append(_Proc(Run(g, f"s{i}", t0), p, out))
        runs = [p.run for p in procs]
        while True:
            for p in procs:
                if p.run.ended_s is None and p.proc is not None and p.proc.poll() is not None:
                    self._ended(p, time.monotonic() - t0)
            elapsed = time.monotonic() - t0
            live = [p for p in procs if p.run.ended_s is None]
            if not live or elapsed >= allowance_s:
                break
            if all(elapsed >= late_after(p.run.group, runs, quickest or {}) for p in live):
                break
            time.sleep(POLL_S)
        stopped_s = time.monotonic() - t0
        live = [p for p in procs if p.run.ended_s is None]
        stop([p.proc for p in live if p.proc is not None])
        steps = []
        for p in procs:
            if p.run.ended_s is None:
                steps.append(Step(p.run.group, self._read(p), None, True, stopped_s))
            elif p.run.result is not None:
                steps.append(Step(p.run.group, p.text, 0, False, p.run.ended_s))
            else:
                steps.append(Step(p.run.group, p.text, p.rc if p.rc else 1, False, p.run.ended_s))
            if p.out is not None:
                p.out.close()
        return steps

    def _ended(self, p: _Proc, now: float) -> None:
        p.rc = p.proc.returncode if p.proc is not None else 127
        output = self._read(p)
        line, why = step_result(output, len(p.run.group) * self.spec.gpus_per_node)
        if p.rc == 0 and line is not None:
            p.run.result, p.text = {"line": line}, line
        else:
            p.text, p.rc = output + "\n" + (why if p.rc == 0 else f"exit {p.rc}: {why}"), p.rc or 1
        p.run.ended_s = now

    @staticmethod
    def _read(p: _Proc) -> str:
        if p.out is None:
            return p.text
        p.out.seek(0)
        return p.out.read().decode(errors="replace")
