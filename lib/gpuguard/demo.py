"""`make demo`: gpuguard end to end on a local 3-node Slurm cluster of simulated 8-GPU p5.48xlarge nodes.

healthy 2-node job runs -> a GPU falls off the bus on node2 -> the next job's prolog drains node2 with a
gpuguard reason -> Slurm requeues the job -> it finishes on the healthy nodes -> what gpuguard found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from gpuguard.devcluster import missing_requirements
from gpuguard.devsite import DevSite, scenario_path

BOLD, DIM, RED, GREEN, YELLOW, RESET = "\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[33m", "\033[0m"
JOB = "#!/bin/sh\n# a stand-in for torchrun: one task per node\nsrun -l hostname\n"


class Out:
    def __init__(self, color: bool) -> None:
        self.color = color

    def c(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self.color else text

    def step(self, n: int, total: int, text: str) -> None:
        print(f"\n{self.c(BOLD, f'[{n}/{total}] {text}')}", flush=True)

    def line(self, text: str = "") -> None:
        print(f"      {text}", flush=True)


def _nodes_table(site: DevSite, out: Out) -> None:
    for node, f in sorted(site.cluster.nodes_info().items()):
        state = f.get("State", "?")
        reason = f.get("Reason")
        color = RED if "DRAIN" in state else GREEN
        out.line(f"{node:<6} {out.c(color, state):<28} {('Reason=' + reason) if reason else ''}")


def _prolog_runs(site: DevSite, job: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for node in site.cluster.node_names:
        for r in site.runs(node, "prolog"):
            if r["job_id"] == job:
                found.append((node, r))
    return sorted(found, key=lambda x: x[1]["started"])


def _fleet_report(site: DevSite, out: Out) -> bool:
    """`gpuguard fleet report` as an admin runs it. The demo has no store.url, so the report runs its SQL over the
    nodes' SQLite stores; with store.url set the same report comes from PostgreSQL (docs/fleet.md)."""
    p = site.gpuguard("fleet", "report", "--since", "1h")
    for line in p.stdout.rstrip().splitlines():
        out.line(line)
    if p.returncode != 0:
        out.line(out.c(RED, p.stderr.strip()))
        return False
    out.line(out.c(DIM, "(SQLite stores here; with store.url: postgresql://... every node ships its history to "
                        "PostgreSQL and the same report covers the fleet)"))
    try:
        rep = json.loads(site.gpuguard("fleet", "report", "--since", "1h", "--json").stdout)
    except ValueError:
        return False
    weekly = {(w["check"], w["drains"]) for w in rep["drains_per_check_per_week"]}
    failures = {n["node"]: n["failures"] for n in rep["nodes"]}
    return ("gpu.xid", 1) in weekly and failures.get("node2") == 1 and failures.get("node1") == 0


def run_demo(keep: bool = False) -> int:
    out = Out(sys.stdout.isatty())
    missing = missing_requirements()
    if missing:
        print("cannot run the demo here: " + "; ".join(missing), file=sys.stderr)
        return 2
    total = 6
    print(out.c(BOLD, "gpuguard demo: a real Slurm cluster on this machine, 3 nodes, each a simulated "
                      "p5.48xlarge (8x H100 80GB, 32 EFA)"))
    print(out.c(DIM, "NVML answers through the real nvidia-ml-py binding over a fake libnvidia-ml.so.1; "
                     "slurmd runs gpuguard's installed prolog before every job."))

    out.step(1, total, "booting munge + slurmctld + 3 slurmd with Prolog=gpuguard-prolog")
    t0 = time.monotonic()
    site = DevSite(nodes=3, scenario="healthy-p5", keep=keep)
    try:
        site.start()
        out.line(f"up in {time.monotonic() - t0:.1f}s (workdir {site.workdir})")
        out.line(f"Prolog={site.libexec / 'gpuguard-prolog'}   config {site.config_path}")
        _nodes_table(site, out)

        out.step(2, total, "a healthy 2-node job (8 GPUs per node)")
        t0 = time.monotonic()
        job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8", "--job-name=train-llm")
        info = site.cluster.wait_job(job, timeout=60)
        out.line(f"job {job} {out.c(GREEN, info['JobState'])} on {info['NodeList']} in {time.monotonic() - t0:.1f}s")
        for node, r in _prolog_runs(site, job):
            nchecks = sum(1 for f in r["findings"] if f["severity"] == "ok")
            out.line(f"gpuguard prolog on {node}: {out.c(GREEN, r['verdict'].upper())} "
                     f"({nchecks} checks ok, {r['duration_ms']:.0f} ms)")

        out.step(3, total, "fault injected: GPU 3 on node2 falls off the bus (Xid 79)")
        site.set_scenario("node2", "xid79")
        out.line(f"node2 now runs scenario {scenario_path('xid79').name}: NVML sees 7 GPUs and the kernel log says")
        out.line(out.c(DIM, "NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."))

        out.step(4, total, "the same 2-node job again")
        t0 = time.monotonic()
        job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8", "--job-name=train-llm")
        info = site.cluster.wait_job(job, timeout=90)
        took = time.monotonic() - t0
        for node, r in _prolog_runs(site, job):
            color = RED if r["verdict"] == "drain" else GREEN
            out.line(f"attempt {(r['restart_count'] or 0) + 1}: gpuguard prolog on {node}: "
                     f"{out.c(color, r['verdict'].upper())} ({r['duration_ms']:.0f} ms)"
                     + (" -> exit 1, node drained, Slurm requeues the job" if r["verdict"] == "drain" else ""))
        ok = info["JobState"] == "COMPLETED"
        out.line(f"job {job} {out.c(GREEN if ok else RED, info['JobState'])} on {info['NodeList']} after "
                 f"{info['Restarts']} requeue(s), {took:.1f}s end to end, no human involved")
        _nodes_table(site, out)

        out.step(5, total, "what gpuguard found on node2 (history store: runs, findings, drains)")
        runs = site.runs("node2", "prolog")
        bad = runs[0]
        for f in bad["findings"]:
            if f["severity"] in ("fail", "warn", "incomplete"):
                out.line(f"{out.c(RED, f['severity'].upper()):<6} {f['check_id']:<12} {f['message']}")
                if f["remediation"]:
                    out.line(out.c(DIM, f"         -> {f['action']}: {f['remediation']}"))
        d = site.store("node2").drains("node2")[0]
        out.line(f"drain: {d['outcome']}  reason: {d['reason']}")
        ev = json.loads([f for f in bad["findings"] if f["check_id"] == "gpu.xid"][0]["evidence"])
        out.line(out.c(DIM, f"evidence: {ev.get('first', '')}"))
        out.line("(more: .venv/bin/gpuguard xid explain 79 ; make demo DEMO_ARGS=--keep keeps the site for "
                 "`gpuguard history`)")

        out.step(6, total, "fleet report of the demo's drains (`gpuguard fleet report`)")
        fleet_ok = _fleet_report(site, out)
        success = ok and info["NodeList"] == "node[1,3]" and (d["reason"] or "").startswith("gpuguard: XID79 gpu.xid") \
            and fleet_ok
    except Exception as e:  # noqa: BLE001 - show what happened, keep the logs
        site.keep = True
        print(f"\ndemo failed: {e}\n(logs kept in {site.workdir})", file=sys.stderr)
        site.cluster.dump_logs()
        success = False
    finally:
        print(f"\n{out.c(DIM, 'tearing down the cluster ...')}", end=" ", flush=True)
        site.stop()
        print("done" + (f" (kept {site.workdir})" if site.keep else ""))
    print(out.c(GREEN if success else RED, "demo OK" if success else "demo FAILED"))
    return 0 if success else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keep", action="store_true", help="keep the site directory (logs, store, scenarios)")
    return run_demo(ap.parse_args().keep)


if __name__ == "__main__":
    raise SystemExit(main())
