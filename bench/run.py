#!/usr/bin/env python3
"""`make bench`: gpuguard's hot paths, measured the way Slurm runs them, each beside its yardstick measured in the
same run (interleaved, so that load from anything else on the machine falls on both alike) and the ratio.

1. prolog wall time on a healthy simulated 8-GPU p5.48xlarge node: the installed hook script, exec'd with the
   bare environment slurmd gives it, with the node agent (`gpuguard watch --agent`) and without it (the hook runs in
   its own process), beside NHC 1.4.3 running 7 host checks (NHC_SRC: a checkout of github.com/mej/nhc, bench/nhc.py)
   and `python -I -c pass` (the interpreter alone). Target: the median at or below NHC's (<= 0.1 s without NHC_SRC);
   the health check likewise (target <= 0.2 s);
2. job start latency on local Slurm clusters: allocation -> batch script start with gpuguard's prolog (with and
   without the agent) beside `Prolog=/bin/true`, jobs interleaved across the clusters (target: <= +0.12 s with the
   agent);
3. `gpuguard xid scan --file` of a generated 1 GiB mixed kern.log beside `grep -c 'NVRM: Xid'` on it, both whole
   processes measured in the same run (target: no slower than grep), and the hooks' reads after a cursor
   (bench/kernel_log_scan.py);
4. watch mode: Xid-to-drain latency on a local cluster beside a bare `scontrol update ... state=drain` (the floor of
   any drain), an Xid 13 flood, idle CPU and RSS (bench/watch_latency.py);
5. central history at fleet scale: every `fleet history` / `fleet report` form on a generated fleet of 10,000
   nodes x 30 days in a real PostgreSQL (target: each under 1 s), and what the fleet stores (bench/fleet_scale.py).

    NHC_SRC=/path/to/nhc python bench/run.py [--prolog-runs 40] [--jobs 12] [--scan-mb 1024] [--watch-samples 20]
                        [--watch-idle-s 60] [--fleet-nodes 10000] [--fleet-days 30]
                        [--skip-cluster] [--skip-scan] [--skip-watch] [--skip-fleet]
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
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT))  # devtools/
sys.path.insert(0, str(ROOT / "bench"))

from devtools.devcluster import DevCluster, missing_requirements  # noqa: E402
from devtools.devsite import DevSite  # noqa: E402
from nhc import find_nhc  # noqa: E402

# (measurement, gpuguard, yardstick, ratio, target, verdict)
ROWS: list[tuple[str, str, str, str, str, str]] = []
NHC_TARGET_S = 0.10  # the prolog's target when NHC itself is not measured (NHC 1.4.3's 7 checks on the 2-core CI box)
HEALTHCHECK_TARGET_S = 0.20
JOB_START_TARGET_S = 0.12


def row(what: str, value: str, target: str, ok: Optional[bool], yardstick: str = "-",
        ratio: Optional[float] = None) -> None:
    verdict = "-" if ok is None else ("ok" if ok else "MISSED")
    r = "-" if ratio is None else f"{ratio:.2f}x"
    ROWS.append((what, value, yardstick, r, target, verdict))
    beside = "" if yardstick == "-" else f" | {yardstick} | {r}"
    print(f"  {what}: {value}{beside} (target {target}) {verdict}", flush=True)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def interleaved(commands: dict[str, tuple[list[str], dict[str, str]]], runs: int, warmup: int = 3,
                env_for: Optional[dict[str, object]] = None) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Wall time (and pid) of each command, run in turn (a, b, c, a, b, c, ...) so that the same load falls on all of
    them. `env_for[name](i)`: extra environment for run i (a fresh job id per prolog)."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    pids: dict[str, list[int]] = {name: [] for name in commands}
    for i in range(runs + warmup):
        for name, (argv, env) in commands.items():
            extra = env_for[name](i) if env_for and name in env_for else {}  # type: ignore[operator]
            t0 = time.perf_counter()
            p = subprocess.Popen(argv, env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd="/")
            _, err = p.communicate()
            dt = time.perf_counter() - t0
            if p.returncode != 0:
                raise SystemExit(f"{name} failed on a healthy node (exit {p.returncode}): {err[-2000:]}")
            pids[name].append(p.pid)
            if i >= warmup:  # the first runs build the simulated node and warm the page cache
                times[name].append(dt)
    return times, pids


def _checks_passed(site: DevSite, kind: str) -> int:
    run = site.runs("node1", kind)[0]
    if run["verdict"] != "pass":
        raise SystemExit(f"{kind} on a healthy node did not pass: {run}")
    return len([f for f in run["findings"] if f["severity"] == "ok"])


def bench_hooks(runs: int, workdir: Path) -> None:
    nhc, nhc_what = find_nhc(workdir / "nhc")
    print(f"[1] prolog and health check wall time, healthy simulated p5.48xlarge node, {runs} runs each, interleaved "
          f"with {nhc_what if nhc else 'no NHC (' + nhc_what + ')'}", flush=True)
    with_agent = DevSite(nodes=1, workdir=workdir / "agent", agent=True)
    alone = DevSite(nodes=1, workdir=workdir / "alone", agent=False)
    try:
        job = {"SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0"}
        cmds: dict[str, tuple[list[str], dict[str, str]]] = {
            "prolog, agent": ([str(with_agent.libexec / "gpuguard-prolog")], with_agent.hook_env("node1", "prolog", **job)),
            "prolog, own process": ([str(alone.libexec / "gpuguard-prolog")], alone.hook_env("node1", "prolog", **job)),
            "health check, agent": ([str(with_agent.libexec / "gpuguard-healthcheck")],
                                    with_agent.hook_env("node1", "healthcheck")),
            "health check, own process": ([str(alone.libexec / "gpuguard-healthcheck")],
                                          alone.hook_env("node1", "healthcheck")),
            "python -I -c pass": ([sys.executable, "-I", "-c", "pass"], {}),
        }
        if nhc:
            cmds["NHC"] = (nhc, {})
        fresh_job = {name: (lambda i: {"SLURM_JOB_ID": str(1000 + i)}) for name in cmds if name.startswith("prolog")}
        t, pids = interleaved(cmds, runs, env_for=fresh_job)  # type: ignore[arg-type]
        print(f"  ({load()})", flush=True)
        checks = {"prolog": _checks_passed(with_agent, "prolog"), "healthcheck": _checks_passed(with_agent, "healthcheck")}
        _check_agent_served(with_agent, pids["prolog, agent"] + pids["health check, agent"])
    finally:
        if with_agent.agent is not None:
            with_agent.stop()
    nhc_med = statistics.median(t["NHC"]) if nhc else None
    floor = statistics.median(t["python -I -c pass"])
    yard = f"NHC {nhc_med:.3f} s" if nhc_med else "NHC not measured"
    for name, target_s in (("prolog, agent", nhc_med or NHC_TARGET_S), ("prolog, own process", None),
                           ("health check, agent", HEALTHCHECK_TARGET_S), ("health check, own process", None)):
        med, p95 = statistics.median(t[name]), pct(t[name], 95)
        target = ("<= NHC" if nhc_med else f"<= {NHC_TARGET_S:g} s") if name == "prolog, agent" else \
            (f"<= {target_s:g} s" if target_s else "-")
        row(f"{name}: median (p95 {p95:.3f} s)", f"{med:.3f} s", target, None if target_s is None else med <= target_s,
            yardstick=yard, ratio=med / nhc_med if nhc_med else None)
    row("python -I -c pass (the interpreter alone): median", f"{floor:.3f} s", "-", None, yardstick=yard,
        ratio=floor / nhc_med if nhc_med else None)
    row("checks passed per prolog / health check", f"{checks['prolog']} / {checks['healthcheck']}", "-", None,
        yardstick=f"NHC {7 if nhc else '-'} host checks")


def _check_agent_served(site: DevSite, hook_pids: list[int]) -> None:
    """The agent really ran the hooks: every run was logged by one of its children, none by the hook process itself
    (a benchmark that silently fell back to running in-process would report the wrong figure)."""
    log = site.log_path.read_text(errors="replace") if site.log_path.exists() else ""
    ran = {int(m) for m in re.findall(r"gpuguard\[(\d+)\] \w+: (?:prolog|healthcheck) node=", log)}
    if not ran or ran & set(hook_pids):
        raise SystemExit(f"the agent did not run every hook ({len(ran & set(hook_pids))} ran in their own process)")


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


def bench_job_latency(jobs: int, workdir: Path) -> None:
    print(f"[2] job start latency, 2-node jobs, {jobs} on each cluster, interleaved: Prolog=/bin/true vs gpuguard's "
          "prolog with the agent and in its own process", flush=True)
    plain = DevCluster(nodes=2, prolog="/bin/true", workdir=workdir / "plain")
    agent = DevSite(nodes=2, workdir=workdir / "agent", agent=True)
    alone = DevSite(nodes=2, workdir=workdir / "alone", agent=False)
    clusters = {"Prolog=/bin/true": plain, "gpuguard prolog, agent": agent.cluster,
                "gpuguard prolog, own process": alone.cluster}
    after: dict[str, list[float]] = {name: [] for name in clusters}
    e2e: dict[str, list[float]] = {name: [] for name in clusters}
    try:
        plain.start()
        agent.start()
        alone.start()
        for i in range(jobs):
            for name, cluster in clusters.items():
                a, e = _job_latency(cluster, i)
                after[name].append(a)
                e2e[name].append(e)
        print(f"  ({load()})", flush=True)
    finally:
        for stop in (plain.stop, agent.stop, alone.stop):
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - stop the others
                print(f"  (stopping a cluster: {exc})")
    base = statistics.median(after["Prolog=/bin/true"])
    yard = f"/bin/true {base:.3f} s"
    for name, target in (("gpuguard prolog, agent", JOB_START_TARGET_S), ("gpuguard prolog, own process", None)):
        med = statistics.median(after[name])
        row(f"allocation -> job start, {name} (median; added)", f"{med:.3f} s ({med - base:+.3f} s)",
            f"<= +{target:g} s" if target else "-", None if target is None else med - base <= target,
            yardstick=yard, ratio=med / base if base > 0 else None)
    row("sbatch -> job start (mean): /bin/true / agent / own process",
        " / ".join(f"{statistics.mean(e2e[n]):.2f} s" for n in clusters), "-", None)


def bench_scan(size_mb: int) -> None:
    print(f"[3] kernel-log Xid scan, {size_mb} MiB generated log: `gpuguard xid scan` vs `grep -c`", flush=True)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_log_scan.py"), "--size-mb", str(size_mb),
                        "--repeat", "5"], capture_output=True, text=True)
    print(p.stdout, end="")
    if p.returncode != 0:
        raise SystemExit(f"kernel_log_scan failed: {p.stderr[-2000:]}")
    grep = re.search(r"\| grep -c NVRM: Xid \(whole process\)\s*\|\s*([\d.]+) \|", p.stdout)
    scan = re.search(r"\| gpuguard xid scan --file --json \(whole process\)\s*\|\s*([\d.]+) \|", p.stdout)
    rescan = re.search(r"\| hooks: FileSource re-read, file unchanged\s*\|\s*([\d.]+) \|", p.stdout)
    incr = re.search(r"\| hooks: FileSource read of 1 MiB appended\s*\|\s*([\d.]+) \|", p.stdout)
    if grep and scan:
        tg, ts = float(grep.group(1)), float(scan.group(1))
        row(f"xid scan of {size_mb} MiB (whole process)", f"{ts:.3f} s", "<= 1.00x grep", ts <= tg,
            yardstick=f"grep -c 'NVRM: Xid' {tg:.3f} s", ratio=ts / tg)
    if rescan:
        t = float(rescan.group(1))
        row("hooks: re-read of the unchanged log (cursor)", f"{t * 1000:.1f} ms", "<= 50 ms", t <= 0.05)
    if incr:
        t = float(incr.group(1))
        row("hooks: read of 1 MiB appended after the cursor", f"{t * 1000:.1f} ms", "<= 50 ms", t <= 0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prolog-runs", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--scan-mb", type=int, default=1024)
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--skip-scan", action="store_true")
    ap.add_argument("--watch-samples", type=int, default=20)
    ap.add_argument("--watch-idle-s", type=float, default=60.0)
    ap.add_argument("--skip-watch", action="store_true")
    ap.add_argument("--fleet-nodes", type=int, default=10000)
    ap.add_argument("--fleet-days", type=int, default=30)
    ap.add_argument("--skip-fleet", action="store_true")
    a = ap.parse_args()
    print(f"gpuguard bench on {os.cpu_count()} CPUs ({load()})")
    with tempfile.TemporaryDirectory(prefix="gg-bench-") as d:
        bench_hooks(a.prolog_runs, Path(d) / "hooks")
        if not a.skip_cluster:
            missing = missing_requirements()
            if missing:
                print("  skipping the cluster benchmark: " + "; ".join(missing))
            else:
                bench_job_latency(a.jobs, Path(d) / "jobs")
    if not a.skip_scan:
        bench_scan(a.scan_mb)
    if not a.skip_watch and not missing_requirements():
        from watch_latency import bench_watch

        bench_watch(samples=a.watch_samples, idle_s=a.watch_idle_s, row=row)
    if not a.skip_fleet:
        from fleet_scale import bench_fleet

        bench_fleet(nodes=a.fleet_nodes, days=a.fleet_days, row=row)
    print(f"\n({load()})\n| measurement | gpuguard | yardstick (same run) | ratio | target | |\n|---|---|---|---|---|---|")
    for what, value, yardstick, ratio, target, verdict in ROWS:
        print(f"| {what} | {value} | {yardstick} | {ratio} | {target} | {verdict} |")
    return 0 if all(r[5] != "MISSED" for r in ROWS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
