"""Fleet sweep: find the node(s) that make a multi-node all_reduce slow, and drain only them.

1. One all_reduce over every node (nccl-tests jobs rendered from the `nccl-tests` sbatch template and
   submitted through Slurm). At or above the threshold: done, the fleet is fine.
2. Otherwise isolate: **pairwise** (disjoint pairs run concurrently; a pair at full speed clears both nodes)
   or **bisect** (halves run concurrently; recurse into the slow halves). Every suspect is then confirmed in a
   2-node run with a node already known good, so a node is convicted only by a run in which it was the only
   unknown. When nothing is known good, suspects are cross-paired once to find some.
3. Convicted nodes are drained (keyword NCCL, the measured figure in the reason, ownership rules of
   `gpuguard.slurm.client.drain_node`), unless more than `max_drain_fraction` of the nodes look slow: that is a
   fabric or configuration problem, and draining half a fleet would make it worse.

The isolation logic (`gpuguard.nccl.isolate.isolate`) is pure: it takes a `measure(groups, stage)` callable, so it
is tested without Slurm; `SlurmRunner` here is the real `measure`.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from gpuguard.nccl.isolate import Group, Measurement, Progress
from gpuguard.nccl.parse import parse_nccl
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.slurm.parse import parse_job_line
from gpuguard.templates import render_template

ThresholdFn = Callable[[int], Optional[float]]

TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                      "DEADLINE", "OUT_OF_MEMORY"})
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._\[\],-]+$")
_TIME_LIMIT = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")


class SweepError(RuntimeError):
    pass


class JobCannotStart(SweepError):
    """A sweep job pends for a reason that waiting never clears: the sweep stops (its jobs cancelled)."""


# Slurm pending reasons that no amount of waiting clears: the request does not fit the partition, QOS or account
# as configured, or the job is held. Resources, Priority, ReqNodeNotAvail, NodeDown ... clear by themselves.
NEVER_CLEARS = frozenset({"BadConstraints", "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit",
                          "InvalidAccount", "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed",
                          "DependencyNeverSatisfied", "JobHeldAdmin", "JobHeldUser", "launch_failed_requeued_held"})


def never_clears(state: Optional[str], reason: str) -> bool:
    """A pending job that will never start as submitted. Pure."""
    return state == "PENDING" and reason.split(",")[0].strip() in NEVER_CLEARS



# --------------------------------------------------------------------------- sbatch rendering

TEMPLATE_NAME = "nccl-tests.sbatch.j2"


def render_job(values: Mapping[str, Any]) -> tuple[str, str]:
    """(script, which template): sbatch_templates/nccl-tests.sbatch.j2 through gpuguard.templates."""
    return render_template(TEMPLATE_NAME, dict(values)), TEMPLATE_NAME


def validate_names(*values: Optional[str]) -> None:
    """Partition and node names end up in #SBATCH lines: refuse anything that could add a line or option."""
    for v in values:
        if v is not None and not _SAFE_NAME.match(v):
            raise SweepError(f"refusing unsafe Slurm name {v!r}")


# --------------------------------------------------------------------------- the Slurm runner


@dataclass
class JobSpec:
    partition: Optional[str]
    gpus_per_node: int = 8
    binary: str = "all_reduce_perf"
    min_bytes: int = 1 << 30
    max_bytes: int = 16 << 30
    iterations: int = 20
    time_limit: str = "00:15:00"
    preset: Optional[str] = None  # the template's NCCL environment preset (default: its own, "generic")
    mpi: str = "pmix"  # srun --mpi plugin the nccl-tests build needs


# the nccl-tests settings of the template's srun line (sbatch_templates/nccl-tests.sbatch.j2: warmup_iters, check);
# tests/unit/test_preflight_nccltests.py holds the rendered template to nccl_tests_argv
WARMUP_ITERS = 5
CHECK_EVERY = 1


def nccl_tests_argv(spec: JobSpec, min_bytes: int, max_bytes: int, step_factor: int, iters: int) -> list[str]:
    """The nccl-tests command line of a multi-node run as the sweep's job runs it (one rank per GPU, `-g 1`):
    `binary -b MIN -e MAX -f F -g 1 -n ITERS -w 5 -c 1`. Pure. The sizes and iterations are the caller's (the
    sweep's are in its JobSpec; the pre-flight passes its own)."""
    return [spec.binary, "-b", str(min_bytes), "-e", str(max_bytes), "-f", str(step_factor), "-g", "1",
            "-n", str(iters), "-w", str(WARMUP_ITERS), "-c", str(CHECK_EVERY)]


def _default_runner(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                          errors="replace")


class SlurmRunner:
    """`measure` for `isolate`: renders one job per group, submits them all with sbatch, waits for them with
    scontrol (every call bounded), parses each job's output."""

    def __init__(self, spec: JobSpec, workdir: str, threshold_for: ThresholdFn, *, job_timeout_s: float = 900.0,
                 poll_s: float = 0.5, command_timeout_s: float = 15.0, progress: Optional[Progress] = None,
                 run: Callable[[list[str], float], subprocess.CompletedProcess[str]] = _default_runner,
                 sbatch: str = "sbatch", scontrol: str = "scontrol", scancel: str = "scancel") -> None:
        validate_names(spec.partition)
        if not _TIME_LIMIT.match(spec.time_limit):
            raise SweepError(f"bad time limit {spec.time_limit!r} (want [D-]HH:MM:SS)")
        self.spec = spec
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.threshold_for = threshold_for
        self.job_timeout_s = job_timeout_s
        self.poll_s = poll_s
        self.command_timeout_s = command_timeout_s
        self.say = progress or (lambda _m: None)
        self._run = run
        self.sbatch, self.scontrol, self.scancel = sbatch, scontrol, scancel
        self.counter = 0
        self.template_used: Optional[str] = None

    def _cmd(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        try:
            return self._run(argv, self.command_timeout_s)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} timed out after {self.command_timeout_s:g}s")
        except OSError as e:
            return subprocess.CompletedProcess(argv, 127, "", f"cannot run {argv[0]}: {e.strerror or e}")

    def submit(self, group: Group, stage: str) -> Measurement:
        validate_names(*group)
        self.counter += 1
        tag = f"{self.counter:03d}-{stage}"
        out_path = self.workdir / f"{tag}.out"
        # the variables of sbatch_templates/nccl-tests.sbatch.j2 (gpuguard.templates rejects unknown ones)
        values: dict[str, Any] = {
            "job_name": f"gg-nccl-{stage}", "nodes": len(group), "nodelist": compress_hostlist(list(group)),
            "partition": self.spec.partition, "gpus_per_node": self.spec.gpus_per_node, "binary": self.spec.binary,
            "min_bytes": str(self.spec.min_bytes), "max_bytes": str(self.spec.max_bytes),
            "iters": self.spec.iterations, "output": str(out_path), "time_limit": self.spec.time_limit,
            "mpi": self.spec.mpi if len(group) > 1 or self.spec.mpi != "none" else "none",
            "job_root": str(self.workdir / "jobs")}
        if self.spec.preset:
            values["preset"] = self.spec.preset
        m = Measurement(nodes=group, stage=stage, threshold_gbps=self.threshold_for(len(group)),
                        output_path=str(out_path))
        try:
            script, self.template_used = render_job(values)
        except Exception as e:  # noqa: BLE001 - a template error is reported, not raised through the sweep
            m.error = f"cannot render the sbatch template: {type(e).__name__}: {e}"
            return m
        script_path = self.workdir / f"{tag}.sbatch"
        script_path.write_text(script)
        p = self._cmd([self.sbatch, "--parsable", str(script_path)])
        if p.returncode != 0:
            m.error = f"sbatch failed: {(p.stderr or p.stdout).strip()[:200]}"
            return m
        m.job_id = p.stdout.strip().split(";")[0]
        return m

    def job_state(self, job_id: str) -> tuple[Optional[str], str]:
        p = self._cmd([self.scontrol, "show", "job", "-o", job_id])
        if p.returncode != 0:
            return None, (p.stderr or p.stdout).strip()[:200]
        f = parse_job_line(p.stdout)
        return f.get("JobState"), f.get("Reason", "")

    def __call__(self, groups: list[Group], stage: str) -> list[Measurement]:
        t0 = time.monotonic()
        ms = [self.submit(g, stage) for g in groups]
        pending = {m.job_id: m for m in ms if m.job_id}
        for m in ms:
            self.say(f"{stage:8} {compress_hostlist(list(m.nodes)):20} "
                     + (f"job {m.job_id} submitted" if m.job_id else f"not submitted: {m.error}"))
        deadline = time.monotonic() + self.job_timeout_s
        reasons: dict[str, str] = {}
        while pending and time.monotonic() < deadline:
            for job_id, m in list(pending.items()):
                state, reason = self.job_state(job_id)
                reasons[job_id] = reason
                if never_clears(state, reason):
                    self._give_up(pending, job_id, m, reason)
                if state in TERMINAL:
                    m.job_state = state
                    del pending[job_id]
            if pending:
                time.sleep(self.poll_s)
        for job_id, m in pending.items():
            self._cmd([self.scancel, job_id])
            m.job_state = "TIMEOUT"
            m.error = f"job {job_id} did not finish within {self.job_timeout_s:g}s (reason {reasons.get(job_id)}); cancelled"
        for m in ms:
            m.duration_s = time.monotonic() - t0
            if m.job_id and m.error is None:
                self._read(m)
            self.say(f"{stage:8} {compress_hostlist(list(m.nodes)):20} {_describe(m)}")
        return ms

    def _give_up(self, pending: dict[str, Measurement], job_id: str, m: Measurement, reason: str) -> None:
        for other in pending:
            self._cmd([self.scancel, other])
        raise JobCannotStart(
            f"job {job_id} ({m.stage} run on {compress_hostlist(list(m.nodes))}) is pending for a reason that never "
            f"clears by waiting: {reason}; its jobs were cancelled. Fix the partition, account or job settings "
            f"(e.g. nccl.sweep_time_limit, sweep_gpus_per_node, --partition) and sweep again")

    def _read(self, m: Measurement) -> None:
        try:
            text = Path(m.output_path or "").read_text(errors="replace")
        except OSError as e:
            m.error = f"job {m.job_id} ({m.job_state}): no output file: {e.strerror}"
            return
        m.result = parse_nccl(text)
        size, busbw = m.result.large_busbw()
        if busbw is None:
            errs = m.result.errors or [ln for ln in text.splitlines() if ln.strip()][-1:]
            m.error = f"job {m.job_id} ({m.job_state}): no result table" + (f": {errs[-1][:160]}" if errs else "")
            return
        m.wrong = int(max(m.result.out_of_bounds or 0, m.result.wrong_total or 0))
        m.size_bytes, m.busbw_gbps = size, busbw


def _describe(m: Measurement) -> str:
    if m.busbw_gbps is None:
        return f"ERROR {m.error or m.job_state}"
    thr = f"{m.threshold_gbps:g}" if m.threshold_gbps is not None else "?"
    extra = f", {m.wrong} wrong values" if m.wrong else ""
    return f"{m.busbw_gbps:8.1f} GB/s (threshold {thr}{extra}) {m.verdict.upper()}  job {m.job_id} {m.duration_s:.1f}s"


# --------------------------------------------------------------------------- thresholds and node lists


def threshold_resolver(fixed: Optional[float], by_nodes: Mapping[Any, Any],
                       baseline: Optional[Callable[[int], Optional[float]]] = None) -> ThresholdFn:
    """n_nodes -> threshold: `by_nodes[n]` (else the entry for the largest count below n), else `fixed`, else
    the baseline proposal for n nodes. Raises SweepError on a malformed mapping (config `sweep_busbw_by_nodes`)."""
    table: dict[int, float] = {}
    for k, v in (by_nodes or {}).items():
        try:
            n, t = int(k), float(v)
        except (TypeError, ValueError):
            raise SweepError(f"nccl.sweep_busbw_by_nodes: expected node count -> GB/s, got {k!r}: {v!r}") from None
        if n < 1 or t <= 0:
            raise SweepError(f"nccl.sweep_busbw_by_nodes: {k!r}: {v!r} out of range")
        table[n] = t

    def resolve(n: int) -> Optional[float]:
        lower = [k for k in table if k <= n]
        if lower:
            return table[max(lower)]
        if fixed is not None:
            return float(fixed)
        return baseline(n) if baseline else None

    return resolve


def parse_sinfo_nodes(text: str) -> tuple[list[str], dict[str, str]]:
    """`sinfo -h -N -o '%N %t'` -> (usable nodes, {skipped node: state}). Drained, down, failing, in
    maintenance or being rebooted nodes are skipped: a sweep must not wait on them nor judge them."""
    usable: list[str] = []
    skipped: dict[str, str] = {}
    bad = ("drain", "drng", "drained", "down", "fail", "maint", "reboot", "boot", "unk", "inval", "futr", "npc",
           "plnd", "pow")
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, state = parts[0], parts[1].lower()
        if name in usable or name in skipped:
            continue
        if state.endswith(("*", "~", "#", "!", "%", "$", "@", "^", "-")) or any(b in state for b in bad):
            skipped[name] = state
        else:
            usable.append(name)
    return usable, skipped


def partition_nodes(partition: str, run: Callable[[list[str], float], subprocess.CompletedProcess[str]] = _default_runner,
                    sinfo: str = "sinfo", timeout_s: float = 15.0) -> tuple[list[str], dict[str, str]]:
    validate_names(partition)
    p = run([sinfo, "-h", "-N", "-p", partition, "-o", "%N %t"], timeout_s)
    if p.returncode != 0:
        raise SweepError(f"sinfo failed: {(p.stderr or p.stdout).strip()[:200]}")
    return parse_sinfo_nodes(p.stdout)


def default_workdir(store_path: str) -> str:
    base = os.path.dirname(store_path) or "."
    return os.path.join(base, "nccl-sweeps", time.strftime("%Y%m%d-%H%M%S"))
