"""`make demo`: gpuguard end to end on a local 3-node Slurm cluster of simulated 8-GPU p5.48xlarge nodes.

healthy 2-node job runs -> a GPU falls off the bus on node2 -> the next job's prolog drains node2 with a
gpuguard reason -> Slurm requeues the job -> it finishes on the healthy nodes -> what gpuguard found -> gpuguard's
own surroundings fail: slurmctld is down while node3 logs an Xid (the drain is pending, applied once it is back,
no job runs there meanwhile), an admin's plain resume of node3 without a GPU reset (drained again at the next job,
the reason says how to clear it; `gpuguard undrain` lifts it once the GPU was reset) and a config typo is deployed (gpuguard keeps protecting, and says where the typo is)
-> a 3-node job's pre-flight on nodes really apart (a network namespace each) blames the one node whose link is
slow and drains it (needs root and torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from devtools.devcluster import missing_requirements
from devtools.devsite import DevSite, scenario_path
from gpuguard.util.fs import atomic_write

BOLD, DIM, RED, GREEN, YELLOW, RESET = "\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[33m", "\033[0m"
JOB = "#!/bin/sh\n# a stand-in for torchrun: one task per node\nsrun -l hostname\n"


def clip(text: str, width: int) -> str:
    """`text` in at most `width` characters: cut at the last word boundary that fits, marked with an ellipsis (a
    single word longer than the line is cut inside it). Empty text says so rather than leave a dangling colon."""
    text = " ".join(str(text).split())
    if not text:
        return "(nothing)"
    if len(text) <= width:
        return text
    head = text[:width - 1]
    cut = head.rfind(" ")
    return (head[:cut].rstrip(" ,;:") if cut > 0 else head) + "…"


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


XID119 = ("NVRM: Xid (PCI:0000:86:00): 119, pid=2113, name=python3, Timeout after 6s of waiting for RPC response "
          "from GPU3 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x204).")


def _controller_down(site: DevSite, out: Out) -> bool:
    """The drain cannot reach slurmctld: it is kept as pending, the node refuses jobs, and it is applied once
    slurmctld is back."""
    path = site.scenarios / "node3.yaml"
    data = yaml.safe_load(path.read_text())
    data["kernel_log"] = list(data.get("kernel_log") or []) + [XID119]
    site.cluster.stop_controller()
    try:
        atomic_write(path, yaml.safe_dump(data, sort_keys=False))
        out.line(out.c(DIM, XID119))
        hc = site.run_hook("healthcheck", "node3")
        line = (site.log_lines("PENDING") or [""])[-1]
        out.line(f"health check on node3 (slurmd runs it, slurmctld is down): {clip(line.split(': ', 1)[-1], 150)}")
        for text in site.gpuguard("status").stdout.splitlines():
            if text.startswith("PENDING"):
                out.line(out.c(YELLOW, clip(text, 160)))
    finally:
        site.cluster.start_controller()
    out.line("slurmctld is back; a job is sent to node3:")
    job = site.cluster.sbatch(JOB, "-N1", "-w", "node3", "--job-name=train-llm")
    site.cluster.wait_nodes(lambda f: "DRAIN" in f, nodes=["node3"], timeout=60)
    applied = (site.log_lines("pending drain applied") or [""])[-1]
    applied = applied.split(": ", 1)[-1]
    out.line(f"node3's prolog applied the pending drain first and refused the job: {clip(applied, 120)}")
    site.cluster.run(["scancel", job])
    reason = site.cluster.node_info("node3").get("Reason") or ""
    _nodes_table(site, out)
    return hc.returncode == 0 and reason.startswith("gpuguard: XID119")


def _plain_resume(site: DevSite, out: Out) -> bool:
    """The condition stands: a plain resume is drained again with a reason that says how to clear it; `gpuguard
    undrain` waits for a GPU reset; after one the node is back."""
    for attempt in range(3):  # slurmctld drains a node whose prolog failed when its slurmd next registers (ms
        try:                  # after the refusal): a resume before that is undone, and the admin resumes again
            site.cluster.resume("node3", timeout=5)
            break
        except Exception:  # noqa: BLE001 - DevCommands raises AssertionError with the logs on a timeout
            if attempt == 2:
                raise
    out.line("the admin runs `scontrol update nodename=node3 state=resume` (no GPU reset); a job is sent to node3:")
    job = site.cluster.sbatch(JOB, "-N1", "-w", "node3", "--job-name=train-llm")
    site.cluster.wait_nodes(lambda f: "DRAIN" in f, nodes=["node3"], timeout=60)
    site.cluster.run(["scancel", job])
    reason = site.cluster.node_info("node3").get("Reason") or ""
    out.line(f"node3's prolog refused the job and drained node3 again: {out.c(YELLOW, clip(reason, 150))}")
    refused = site.gpuguard("undrain", "node3")
    out.line(f"gpuguard undrain node3 -> {refused.returncode}: {clip((refused.stdout + refused.stderr).strip(), 150)}")
    module = site.workdir / "sim" / "node3" / "sys" / "module" / "nvidia"  # the GPU reset: the driver reloaded
    module.rename(module.with_name("nvidia.before-reset"))
    module.mkdir()
    out.line("the GPU is reset (the nvidia driver unloaded and loaded again: `nvidia-smi -r`)")
    lifted = site.gpuguard("undrain", "node3")
    said = lifted.stdout.strip()
    said = said.split(" (was:")[0] + ("; cleared:" + said.split("; cleared:")[1] if "; cleared:" in said else "")
    out.line(f"gpuguard undrain node3 -> {lifted.returncode}: {clip(said, 150)}")
    site.cluster.wait_nodes(lambda f: "NOT_RESPONDING" not in f, nodes=["node3"], timeout=15)
    _nodes_table(site, out)
    return "[standing reset]" in reason and refused.returncode == 1 and lifted.returncode == 0 \
        and "DRAIN" not in site.cluster.node_flags("node3")


def _config_typo(site: DevSite, out: Out) -> bool:
    good = site.config_path.read_text()
    site.config_path.write_text(good + "deadlines:\n  prolog_s: soon\n")
    try:
        out.line("config.yaml now ends with `deadlines: {prolog_s: soon}` (a typo, on every node at once)")
        job = site.cluster.sbatch(JOB, "-N1", "-w", "node1", "--job-name=train-llm")
        info = site.cluster.wait_job(job, timeout=60)
        out.line(f"job {job} {out.c(GREEN if info['JobState'] == 'COMPLETED' else RED, info['JobState'])} on "
                 f"{info['NodeList']}: the healthy node keeps running jobs, the drained ones stay drained")
        status = site.gpuguard("status").stdout.splitlines()
        for text in status:
            if text.startswith("CONFIG BROKEN"):
                out.line(out.c(YELLOW, clip(text, 170)))
        check = site.gpuguard("config", "--check", str(site.config_path))
        out.line(f"gpuguard config --check: {check.stdout.strip().splitlines()[0]}")
        return info["JobState"] == "COMPLETED" and any("deadlines.prolog_s" in t for t in status)
    finally:
        site.config_path.write_text(good)


def run_demo(keep: bool = False) -> int:
    out = Out(sys.stdout.isatty())
    missing = missing_requirements()
    if missing:
        print("cannot run the demo here: " + "; ".join(missing), file=sys.stderr)
        return 2
    print(out.c(BOLD, "gpuguard demo: a real Slurm cluster on this machine, 3 nodes, each a simulated "
                      "p5.48xlarge (8x H100 80GB, 32 EFA)"))
    print(out.c(DIM, "NVML answers through the real nvidia-ml-py binding over a fake libnvidia-ml.so.1; "
                     "slurmd runs gpuguard's installed prolog before every job."))

    out.step(1, TOTAL_STEPS, "booting munge + slurmctld + 3 slurmd with Prolog=gpuguard-prolog")
    t0 = time.monotonic()
    site = DevSite(nodes=3, scenario="healthy-p5", keep=keep)
    try:
        site.start()
        out.line(f"up in {time.monotonic() - t0:.1f}s (workdir {site.workdir})")
        out.line(f"Prolog={site.libexec / 'gpuguard-prolog'}   config {site.config_path}")
        _nodes_table(site, out)
        success = _story(site, out)
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


TOTAL_STEPS = 10


def _story(site: DevSite, out: Out) -> bool:
    """Steps 2-9 on a booted site; True when every one showed what it should."""
    out.step(2, TOTAL_STEPS, "a healthy 2-node job (8 GPUs per node)")
    _healthy_job(site, out)

    out.step(3, TOTAL_STEPS, "fault injected: GPU 3 on node2 falls off the bus (Xid 79)")
    site.set_scenario("node2", "xid79")
    out.line(f"node2 now runs scenario {scenario_path('xid79').name}: NVML sees 7 GPUs and the kernel log says")
    out.line(out.c(DIM, "NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."))

    out.step(4, TOTAL_STEPS, "the same 2-node job again")
    info = _job_after_the_fault(site, out)

    out.step(5, TOTAL_STEPS, "what gpuguard found on node2 (history store: runs, findings, drains)")
    drain = _findings_on_node2(site, out)

    out.step(6, TOTAL_STEPS, "fleet report of the demo's drains (`gpuguard fleet report`)")
    fleet_ok = _fleet_report(site, out)

    out.step(7, TOTAL_STEPS, "slurmctld goes down while node3's GPU logs Xid 119 (GSP timeout)")
    pending_ok = _controller_down(site, out)

    out.step(8, TOTAL_STEPS, "a fault stands until it is cleared: a plain resume of node3 without a GPU reset")
    standing_ok = _plain_resume(site, out)

    out.step(9, TOTAL_STEPS, "a config typo is deployed to every node")
    config_ok = _config_typo(site, out)

    out.step(10, TOTAL_STEPS, "a multi-node pre-flight: node3's link is slow (tc), the job's nodes each in a network "
                              "namespace of their own")
    preflight_ok = _preflight_blame(out)
    return info["JobState"] == "COMPLETED" and info["NodeList"] == "node[1,3]" \
        and (drain["reason"] or "").startswith("gpuguard: XID79 gpu.xid") and fleet_ok and pending_ok \
        and standing_ok and config_ok and preflight_ok


def _preflight_blame(out: Out) -> bool:
    """`gpuguard preflight` in a 3-node job on a cluster of its own (devtools.devnetns): node3 blamed and drained."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from devtools.devnetns import NodeNetworks
    from preflight_cost import missing_preflight  # type: ignore[import-not-found]

    why = missing_preflight()
    if why:
        out.line(out.c(YELLOW, f"skipped: {why}"))
        return True
    site = DevSite(nodes=3, host_view=NodeNetworks())
    try:
        site.start()
        site.write_config({"nccl": {"preflight_busbw_gbps": 0.005, "preflight_max_bytes": 262144,
                                    "preflight_iterations": 2}})
        site.cluster.host_view.slow_link(3, "20mbit")
        out.line("node3's link throttled to 20 mbit; the job's script runs `gpuguard preflight` before its work")
        job = site.cluster.sbatch(f"#!/bin/sh\n{sys.executable} -m gpuguard --config {site.config_path} preflight "
                                  "--budget 60\n", "-N3", "--time=3")
        site.cluster.wait_job(job, timeout=150)
        text = site.cluster.job_output(job)
        for line in text.splitlines():
            out.line(out.c(RED, line) if "blamed" in line else line)
        _nodes_table(site, out)
        reason = site.cluster.nodes_info()["node3"].get("Reason") or ""
        return "blamed node3" in text and reason.startswith("gpuguard: NCCL fabric.nccl")
    finally:
        site.stop()


def _healthy_job(site: DevSite, out: Out) -> None:
    t0 = time.monotonic()
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8", "--job-name=train-llm")
    info = site.cluster.wait_job(job, timeout=60)
    out.line(f"job {job} {out.c(GREEN, info['JobState'])} on {info['NodeList']} in {time.monotonic() - t0:.1f}s")
    for node, r in _prolog_runs(site, job):
        nchecks = sum(1 for f in r["findings"] if f["severity"] == "ok")
        out.line(f"gpuguard prolog on {node}: {out.c(GREEN, r['verdict'].upper())} "
                 f"({nchecks} checks ok, {r['duration_ms']:.0f} ms)")


def _job_after_the_fault(site: DevSite, out: Out) -> dict[str, str]:
    """The job's final fields: node2's prolog drains, Slurm requeues the job onto the healthy nodes."""
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
    return info


def _findings_on_node2(site: DevSite, out: Out) -> dict[str, Any]:
    """What the drained node's store says: the failing findings, the drain (returned), the evidence."""
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
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keep", action="store_true", help="keep the site directory (logs, store, scenarios)")
    return run_demo(ap.parse_args().keep)


if __name__ == "__main__":
    raise SystemExit(main())
