#!/usr/bin/env python3
"""`make bench`: gpuguard's hot paths, measured the way Slurm runs them, each beside its yardstick measured in the
same run, interleaved (a, b, a, b, ...: load from anything else on the machine falls on both alike). Every figure
is printed as median [p10-p90] n=runs, every section with the load average before and after it; a target measured
while the load average was above the CPU count is BUSY (too busy to judge), not PASS or MISS (bench/figures.py).

The targets (issue 30), first in the summary table:
- prolog in its own process <= NHC (NHC 1.4.3 running 7 host checks, bench/nhc.py; `make bench` clones it into
  build/nhc when it can, or NHC_SRC names a checkout) and through the node agent <= 0.5x NHC: the installed hook
  script exec'd with the bare environment slurmd gives it, on a healthy simulated 8-GPU p5.48xlarge node;
- allocation -> batch script start on a local Slurm cluster with gpuguard's prolog through the agent <= +0.12 s over
  `Prolog=/bin/true`, jobs interleaved across the clusters;
- `gpuguard xid scan --file` of a generated 1 GiB mixed kern.log <= 0.5x `grep -c 'NVRM: Xid'` on it, both whole
  processes (bench/kernel_log_scan.py).
Also: the health check, the hooks' kernel-log reads after a cursor, watch mode (Xid -> drain latency beside a bare
`scontrol update state=drain`, an Xid 13 flood, idle CPU and RSS: bench/watch_latency.py) and the central history
at fleet scale (every `fleet history` / `fleet report` form on a generated fleet in PostgreSQL: bench/fleet_scale.py),
and the multi-node pre-flight's cost on job start per node count, idle and under CPU load, beside the cost of one lost
job (bench/preflight_cost.py).

    NHC_SRC=/path/to/nhc python bench/run.py [--prolog-runs 30] [--jobs 12] [--scan-mb 1024] [--scan-repeat 7]
        [--watch-samples 15] [--watch-idle-s 30] [--fleet-nodes 10000] [--fleet-days 30] [--strict]
        [--preflight-runs 3] [--skip-cluster] [--skip-scan] [--skip-watch] [--skip-fleet] [--skip-preflight]

Exit status 0 when every section ran (whatever the verdicts); with --strict, 1 when a target was MISSed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT))  # devtools/
sys.path.insert(0, str(ROOT / "bench"))

from devtools.devcluster import DevCluster, missing_requirements  # noqa: E402
from devtools.devsite import DevSite  # noqa: E402
from figures import Load, Measuring, Table, ratio_spread, spread  # noqa: E402
from nhc import find_nhc  # noqa: E402

HEALTHCHECK_TARGET_S = 0.20
JOB_START_TARGET_S = 0.12
OWN_PROCESS_VS_NHC = 1.0
AGENT_VS_NHC = 0.5
KEY_PROLOG_OWN = "prolog in its own process (no agent)"
KEY_PROLOG_AGENT = "prolog through the node agent"
KEY_JOB_START = "allocation -> job start added by the prolog, through the agent"
KEY_SCAN = "`gpuguard xid scan --file` of the generated kern.log"

Command = tuple[list[str], dict[str, str]]


def interleaved(commands: dict[str, Command], runs: int, warmup: int = 3,
                env_for: Optional[dict[str, Callable[[int], dict[str, str]]]] = None) -> dict[str, list[float]]:
    """Wall time of each command, run in turn so that the same load falls on all of them; the order rotates every
    round (no command always runs right after the same other one). `env_for[name](i)`: extra environment for
    round i (a fresh job id per prolog)."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for i in range(runs + warmup):
        for name in names[i % len(names):] + names[:i % len(names)]:
            argv, env = commands[name]
            extra = env_for[name](i) if env_for and name in env_for else {}
            t0 = time.perf_counter()
            p = subprocess.run(argv, env={**env, **extra}, capture_output=True, text=True, cwd="/", timeout=120)
            dt = time.perf_counter() - t0
            if p.returncode != 0:
                raise SystemExit(f"{name} failed on a healthy node (exit {p.returncode}): {p.stderr[-2000:]}")
            if i >= warmup:  # the first runs build the simulated node and warm the page cache
                times[name].append(dt)
    return times


def _checks_passed(site: DevSite, kind: str) -> int:
    run = site.runs("node1", kind)[0]
    if run["verdict"] != "pass":
        raise SystemExit(f"{kind} on a healthy node did not pass: {run}")
    return len([f for f in run["findings"] if f["severity"] == "ok"])


def _via_agent(site: DevSite, kind: str) -> tuple[int, int]:
    """(hook runs the agent served, all hook runs) of one kind, from the site's log: a run that fell back to its
    own process is in the "agent" figure too, so the table says how many there were."""
    lines = [ln for ln in site.log_lines(f" {kind} node=") if " took=" in ln or " verdict=" in ln]
    return sum(1 for ln in lines if "via=agent" in ln), len(lines)


def _hook_commands(agent: DevSite, alone: DevSite, nhc: Optional[list[str]]) -> dict[str, Command]:
    job = {"SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0"}
    cmds: dict[str, Command] = {
        "prolog, agent": ([str(agent.libexec / "gpuguard-prolog")], agent.hook_env("node1", "prolog", **job)),
        "prolog, own process": ([str(alone.libexec / "gpuguard-prolog")], alone.hook_env("node1", "prolog", **job)),
        "health check, agent": ([str(agent.libexec / "gpuguard-healthcheck")], agent.hook_env("node1", "healthcheck")),
        "health check, own process": ([str(alone.libexec / "gpuguard-healthcheck")],
                                      alone.hook_env("node1", "healthcheck")),
        "python -I -c pass": ([sys.executable, "-I", "-c", "pass"], {}),
    }
    if nhc:
        cmds["NHC"] = (nhc, {})
    return cmds


def bench_hooks(table: Table, runs: int, workdir: Path) -> None:
    nhc, nhc_what = find_nhc(workdir / "nhc")
    print(f"[1] prolog and health check wall time, healthy simulated p5.48xlarge node, {runs} rounds, interleaved, "
          f"with {nhc_what}", flush=True)
    agent = DevSite(nodes=1, workdir=workdir / "agent", agent=True)
    alone = DevSite(nodes=1, workdir=workdir / "alone", agent=False)
    try:
        cmds = _hook_commands(agent, alone, nhc)
        fresh_job = {name: (lambda i: {"SLURM_JOB_ID": str(1000 + i)}) for name in cmds if name.startswith("prolog")}
        with Measuring() as load:
            t = interleaved(cmds, runs, env_for=fresh_job)
        checks = {kind: _checks_passed(agent, kind) for kind in ("prolog", "healthcheck")}
        served = {kind: _via_agent(agent, kind) for kind in ("prolog", "healthcheck")}
        with Measuring() as burst_load:
            burst = _burst(agent, cmds["prolog, agent"], BURST)
    finally:
        agent.stop()
        alone.stop()
    _hook_rows(table, t, load, checks, served, nhc_what if nhc else None)
    table.row(f"a burst of {BURST} prologs at once through the agent: served by it / fell back (why) / wall",
              f"{burst[0]} / {burst[1]} / {burst[2]:.2f} s", "all served", burst[0] == BURST, load=burst_load)


BURST = 12  # a job array's prologs starting on one node at once (200 jobs on 16 nodes: 12-13 each)


def _burst(site: DevSite, prolog: Command, n: int) -> tuple[int, str, float]:
    """(served by the agent, the fallbacks by reason, wall time) of `n` prologs started at once (issue 30: with a
    flat 0.5 s bound, most of a burst's prologs fell back to their own processes on a loaded node)."""
    argv, env = prolog
    jobs = [str(90000 + i) for i in range(n)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(argv, env={**env, "SLURM_JOB_ID": job}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd="/") for job in jobs]
    for p in procs:
        p.wait(timeout=120)
    wall = time.perf_counter() - t0
    lines = [ln for ln in site.log_lines(" prolog node=") if any(f" job={job} " in ln for job in jobs)]
    why = [m.group(1) for m in (re.search(r" via=local\((.*?)\)(?: |$)", ln) for ln in lines) if m]
    fell_back = f"{len(why)}" + (f" ({'; '.join(sorted(set(why)))})" if why else "")
    return sum(" via=agent" in ln for ln in lines), fell_back, wall


def _hook_rows(table: Table, t: dict[str, list[float]], load: Load, checks: dict[str, int],
               served: dict[str, tuple[int, int]], nhc_what: Optional[str]) -> None:
    nhc_t = t.get("NHC")
    yard = f"{nhc_what}: {spread(nhc_t)}" if nhc_t else "NHC not measured"
    for key, name, limit in ((KEY_PROLOG_OWN, "prolog, own process", OWN_PROCESS_VS_NHC),
                             (KEY_PROLOG_AGENT, "prolog, agent", AGENT_VS_NHC)):
        target = f"<= {limit:g}x NHC"
        if nhc_t is None:
            table.missing(key, target, "no NHC checkout (NHC_SRC): " + spread(t[name]))
            continue
        r, r_text = ratio_spread(t[name], nhc_t)
        table.row(key, spread(t[name]), target, r <= limit, yardstick=yard, ratio=r_text, load=load, key=True)
    for name in ("health check, agent", "health check, own process"):
        r_text = ratio_spread(t[name], nhc_t)[1] if nhc_t else None
        agent_run = name.endswith("agent")
        table.row(name, spread(t[name]), f"<= {HEALTHCHECK_TARGET_S:g} s" if agent_run else "-",
                  statistics.median(t[name]) <= HEALTHCHECK_TARGET_S if agent_run else None,
                  yardstick=yard, ratio=r_text, load=load)
    table.row("python -I -c pass (the interpreter alone)", spread(t["python -I -c pass"]), "-", None, yardstick=yard,
              ratio=ratio_spread(t["python -I -c pass"], nhc_t)[1] if nhc_t else None, load=load)
    table.row("checks passed per prolog / health check", f"{checks['prolog']} / {checks['healthcheck']}", "-", None,
              yardstick=f"NHC: {7 if nhc_t else '-'} host checks")
    table.row("hooks the agent served (the rest fell back to their own process)",
              " / ".join(f"{kind} {a} of {n}" for kind, (a, n) in served.items()), "all", 
              all(a == n for a, n in served.values()), load=load)


def _started_at(cluster: DevCluster, job: str) -> float:
    """When slurmctld allocated the job and started it (its log, millisecond timestamps, local time)."""
    # backfill says "_start_job: Started JobId=N", the main scheduler (a job placed at submit) "sched: Allocate JobId=N"
    pattern = re.compile(r"^\[(\S+)\] .*(?:_start_job: Started|sched: Allocate) JobId=%s " % re.escape(job))
    for line in cluster.logs()["slurmctld"].read_text().splitlines():
        m = pattern.match(line)
        if m:
            return datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    raise SystemExit(f"no start of job {job} in the slurmctld log")


def _job_latency(cluster: DevCluster, i: int) -> tuple[float, float]:
    """One trivial 2-node job: (allocation -> batch script's first line, sbatch -> batch script's first line).

    The first figure is what a prolog adds to every job start. The second also contains the wait for the
    scheduler's next pass (bf_interval=1 s), whose phase varies from job to job, so it is reported as context."""
    stamp = cluster.jobs_dir / f"start-{i}"
    t0 = time.time()
    job = cluster.sbatch(f"#!/bin/sh\ndate +%s.%N > {stamp}\n", "-N2", "--gres=gpu:8")
    info = cluster.wait_job(job, timeout=60)
    if info["JobState"] != "COMPLETED":
        raise SystemExit(f"bench job failed: {info}")
    started = float(stamp.read_text())
    return started - _started_at(cluster, job), started - t0


def bench_job_latency(table: Table, jobs: int, workdir: Path) -> None:
    print(f"[2] job start latency, 2-node jobs, {jobs} on each cluster, interleaved: Prolog=/bin/true vs gpuguard's "
          "prolog through the agent and in its own process", flush=True)
    plain = DevCluster(nodes=2, prolog="/bin/true", workdir=workdir / "plain")
    agent = DevSite(nodes=2, workdir=workdir / "agent", agent=True)
    alone = DevSite(nodes=2, workdir=workdir / "alone", agent=False)
    clusters = {"true": plain, "agent": agent.cluster, "own": alone.cluster}
    after: dict[str, list[float]] = {name: [] for name in clusters}
    e2e: dict[str, list[float]] = {name: [] for name in clusters}
    try:
        plain.start()
        agent.start()
        alone.start()
        with Measuring() as load:
            for i in range(jobs):
                order = list(clusters)[i % 3:] + list(clusters)[:i % 3]
                for name in order:
                    a, e = _job_latency(clusters[name], i)
                    after[name].append(a)
                    e2e[name].append(e)
    finally:
        for stop in (plain.stop, agent.stop, alone.stop):
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - stop the others
                print(f"  (stopping a cluster: {exc})")
    base = statistics.median(after["true"])
    yard = f"Prolog=/bin/true: {spread(after['true'])}"
    for name, what, key in (("agent", KEY_JOB_START, True),
                            ("own", "allocation -> job start added by the prolog, own process", False)):
        added = statistics.median(after[name]) - base
        per_round = [a - b for a, b in zip(after[name], after["true"])]
        value = f"{added:+.3f} s (median - median; per round {spread(per_round)})"
        table.row(what, value, f"<= +{JOB_START_TARGET_S:g} s" if key else "-",
                  added <= JOB_START_TARGET_S if key else None, yardstick=yard, load=load, key=key)
    table.row("sbatch -> job start: /bin/true / agent / own process",
              " / ".join(spread(e2e[n], digits=2) for n in clusters), "-", None, load=load)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prolog-runs", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--scan-mb", type=int, default=1024)
    ap.add_argument("--scan-repeat", type=int, default=7)
    ap.add_argument("--watch-samples", type=int, default=15)
    ap.add_argument("--watch-idle-s", type=float, default=30.0)
    ap.add_argument("--fleet-nodes", type=int, default=10000)
    ap.add_argument("--fleet-days", type=int, default=30)
    ap.add_argument("--preflight-runs", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target was missed")
    for part in ("cluster", "scan", "watch", "fleet", "preflight"):
        ap.add_argument(f"--skip-{part}", action="store_true")
    a = ap.parse_args()
    t0 = time.monotonic()
    print(f"gpuguard bench on {os.cpu_count()} CPUs (load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())})")
    table = Table()
    missing = missing_requirements()
    with tempfile.TemporaryDirectory(prefix="gg-bench-") as d:
        bench_hooks(table, a.prolog_runs, Path(d) / "hooks")
        if a.skip_cluster or missing:
            print("  skipping the cluster benchmark" + (": " + "; ".join(missing) if missing else ""))
            table.missing(KEY_JOB_START, f"<= +{JOB_START_TARGET_S:g} s", "cluster part skipped")
        else:
            bench_job_latency(table, a.jobs, Path(d) / "jobs")
    if a.skip_scan:
        table.missing(KEY_SCAN, "<= 0.5x grep", "--skip-scan")
    else:
        from kernel_log_scan import bench_scan

        bench_scan(table, a.scan_mb, a.scan_repeat, key=KEY_SCAN)
    if not a.skip_watch and not missing:
        from watch_latency import bench_watch

        bench_watch(samples=a.watch_samples, idle_s=a.watch_idle_s, row=table.row)
    if not a.skip_fleet:
        from fleet_scale import bench_fleet

        bench_fleet(nodes=a.fleet_nodes, days=a.fleet_days, row=table.row)
    if not a.skip_preflight:  # last: its busy loops raise the load average for a minute after them
        from preflight_cost import bench_preflight, missing_preflight

        why = missing_preflight()
        if why:
            print(f"  skipping the pre-flight benchmark: {why}")
        else:
            with tempfile.TemporaryDirectory(prefix="gg-bench-") as d:
                bench_preflight(table.row, Path(d) / "preflight", runs=a.preflight_runs)
    print(f"\nbench took {time.monotonic() - t0:.0f} s; load average now "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    table.print()
    return 1 if a.strict and table.missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
