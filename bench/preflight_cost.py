"""`make bench` section: what `gpuguard preflight` adds to a multi-node job's start, per node count, beside what one
lost job costs (issue 28 item 5).

Measured on the namespaced dev cluster (devtools.devnetns.NodeNetworks: each node its own network namespace, gloo
over a bridge, one persistent worker per node importing CPU torch), healthy nodes, 256 KiB all_reduce at most: the
pre-flight's own figure from its job line ("in X s", the workers' start-up and each round), each node count with
and without extra CPU load (`busy` python loops, one per core, for the whole measurement). On this machine every
"node" shares the same cores: the workers' torch imports run side by side, so the figure grows with the node count
here while on a real cluster (a node's own CPUs) it does not.

The lost job is a model, not a measurement: a job started on a node with a bad link hangs in its first collective
until the collective timeout (PyTorch's default, 600 s for NCCL), then is requeued and starts again; every node of
the job is idle for that time. The pre-flight pays for itself when more than one job in `lost / preflight` would
have started on such a node."""

from __future__ import annotations

import multiprocessing
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional
from contextlib import contextmanager

from figures import Measuring, spread

LOST_TIMEOUT_S = 600.0  # torch.distributed's default collective timeout for NCCL (ProcessGroupNCCL)
REQUEUE_S = 60.0  # Slurm's requeue and the next start: scheduler pass, prolog, torch import, rendezvous (order of)
TARGET_S = 20.0  # the budget on up to 64 nodes (nccl.preflight_budget_s default)
# the bracket starts with the floor and the sample ([floor 0.005 GB/s (config), sample recorded, workers up in 2.1s, ...])
LINE = re.compile(r"gpuguard preflight: (\d+) nodes \S+ in ([\d.]+)s: ([^\[\n]*)(?:\[[^\]\n]*?workers up in ([\d.]+)s)?")


def _spin(stop: "multiprocessing.synchronize.Event") -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        sum(i * i for i in range(10000))


@contextmanager
def busy(loops: int) -> Iterator[None]:
    """`loops` busy python processes (a `stress`-like CPU load) for the block."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(loops)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def one_run(site, nodes: int, budget: int) -> tuple[float, float, str]:
    """(pre-flight seconds, workers' start-up seconds, verdict) of one healthy job."""
    c = site.cluster
    job = c.sbatch(f"#!/bin/sh\n{sys.executable} -m gpuguard --config {site.config_path} preflight "
                   f"--budget {budget}\n", f"-N{nodes}", "--time=3")
    info = c.wait_job(job, timeout=budget + 90)
    out = c.job_output(job)
    m = LINE.search(out)
    if info["JobState"] != "COMPLETED" or not m:
        raise SystemExit(f"pre-flight bench job failed: {info}\n{out}")
    return float(m.group(2)), float(m.group(4) or 0.0), m.group(3).split(",")[0]


def bench_preflight(row: Callable[..., None], workdir: Path, node_counts: tuple[int, ...] = (2, 4),
                    runs: int = 3, loads: tuple[int, ...] = (0, 2), budget: int = 60) -> None:
    from devtools.devnetns import NodeNetworks
    from devtools.devsite import DevSite

    print(f"[pre-flight] `gpuguard preflight` on job start, healthy namespaced nodes, {runs} jobs per node count, "
          f"without and with {max(loads)} busy loops", flush=True)
    lost = LOST_TIMEOUT_S + REQUEUE_S
    for n in node_counts:
        site = DevSite(nodes=n, workdir=workdir / f"n{n}", host_view=NodeNetworks())
        try:
            site.start()
            site.write_config({"nccl": {"preflight_busbw_gbps": 0.005, "preflight_max_bytes": 262144,
                                        "preflight_iterations": 2}})
            one_run(site, n, budget)  # warm: the page cache holds torch after the first import
            for loops in loads:
                took, up, verdicts = [], [], []
                with busy(loops), Measuring() as load:
                    for _ in range(runs):
                        t, u, v = one_run(site, n, budget)
                        took.append(t)
                        up.append(u)
                        verdicts.append(v)
                worst = max(took)
                row(f"pre-flight on a healthy {n}-node job start ({loops} busy loops): seconds (workers up in)",
                    f"{spread(took, digits=1)} (up {spread(up, digits=1)}; {', '.join(sorted(set(verdicts)))})",
                    f"<= {TARGET_S:g} s", worst <= TARGET_S,
                    yardstick=f"one lost job: ~{lost:.0f} s x {n} nodes (model: {LOST_TIMEOUT_S:.0f} s collective "
                              f"timeout + ~{REQUEUE_S:.0f} s requeue)",
                    ratio=f"1 lost job = {lost / max(1e-9, sorted(took)[len(took) // 2]):.0f} pre-flights",
                    load=load)
        finally:
            try:
                site.stop()
            except Exception as exc:  # noqa: BLE001 - the next node count still runs
                print(f"  (stopping the cluster: {exc})")


def missing_preflight() -> Optional[str]:
    """Why this section cannot run here, or None."""
    import importlib.util
    import os

    from devtools.devhost import missing_host_view_requirements

    missing = list(missing_host_view_requirements())
    if os.geteuid() != 0:
        missing.append("not root (network namespaces)")
    if importlib.util.find_spec("torch") is None:
        missing.append("no torch (make torch)")
    return "; ".join(missing) or None
