"""A simulated nccl-tests `all_reduce_perf` for local clusters of simulated nodes.

    GPUGUARD_SIM_SCENARIO_DIR=<dir> python -m devtools.nccl_tests_stub -b 512M -e 4G -f 2 -g 8 [-J out.json]

or install it as an executable next to the scenarios (`install_stub`). It behaves like an MPI build of
nccl-tests launched under `srun` (one task per GPU with `-g 1`, or one per node with `-g 8`): every task reads the job's node list
(`SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST`, else just `SLURMD_NODENAME`), and only rank 0
(`SLURM_PROCID`) prints the modern layout (`# nccl-tests version ...`, device lines, the table, the footer);
`srun -l` adds its `0: ` prefix itself.

Bandwidth comes from each node's scenario (`<dir>/<node>.yaml`, else `default.yaml`), top-level key `nccl`:

    nccl: {busbw_gbps: 360}       # this node's large-message bus bandwidth (default 400)
    nccl: {slow_factor: 0.4}      # ... times this factor (a degraded link or GPU)
    nccl: {wrong: 12}             # the collective returns wrong data (#wrong / out-of-bounds values)
    nccl: {fail: "NCCL WARN NET/OFI ..."}  # the run dies with this error before the table
    nccl: {hang_s: 30}            # the run hangs
    nccl: {measure: tcp}          # measured, not computed: the ranks run a ring all_reduce over TCP between the
                                  # nodes (devtools.nccl_ring), so a slowed link really reads slow
    nccl: {env_dir: /some/dir}    # each rank writes the NCCL/EFA environment it was started with there
                                  # (<node>.<rank>.json: NCCL_*, FI_*, TORCH_NCCL_*, OFI_NCCL_*)

A multi-node run is as slow as its slowest member, as with real NCCL rings. Computed (the default), small messages
are latency bound (time = latency + bytes/bandwidth), so the table has the familiar shape; values are deterministic.
Measured, the table holds the ring's own times; the layout is the same either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

from devtools.nccl_ring import RingError
from gpuguard.nccl.table import parse_size

ENV_SCENARIO_DIR = "GPUGUARD_SIM_SCENARIO_DIR"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUSBW_GBPS = 400.0
LATENCY_US = 25.0
NCCL_TESTS_VERSION = "2.17.6"
NCCL_CODE = 22602


def node_scenario_key(scenario: Optional[str], node: str, key: str) -> dict[str, Any]:
    """The `key:` mapping of `node`'s scenario: `<dir>/<node>.yaml`, else `<dir>/default.yaml`, or the one
    scenario file when `scenario` is a file ({} when none)."""
    if not scenario:
        return {}
    import yaml

    base = Path(scenario)
    candidates = [base] if base.is_file() else [base / f"{node}.yaml", base / "default.yaml"]
    for path in candidates:
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            spec = data.get(key) if isinstance(data, dict) else None
            return dict(spec) if isinstance(spec, dict) else {}
    return {}


def node_nccl_spec(scenario_dir: Optional[str], node: str) -> dict[str, Any]:
    return node_scenario_key(scenario_dir, node, "nccl")


def node_busbw(spec: dict[str, Any]) -> float:
    return float(spec.get("busbw_gbps", DEFAULT_BUSBW_GBPS)) * float(spec.get("slow_factor", 1.0))


def job_nodes(env: dict[str, str]) -> list[str]:
    from gpuguard.slurm.hostlist import expand_hostlist

    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(var):
            return expand_hostlist(env[var])
    return [env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]]


def measured_rows(times: list[tuple[float, float]], ranks: int, sizes: list[int], wrong: int = 0
                  ) -> list[tuple[int, int, float, float, float, int, float, float, float, int]]:
    """The table's rows from measured (out-of-place, in-place) microseconds per size (pure): algbw = size / time,
    busbw = algbw * 2 (n - 1) / n, as nccl-tests computes them for all_reduce."""
    factor = 2.0 * (ranks - 1) / ranks if ranks > 1 else 0.0
    rows = []
    for i, (size, (t_oop, t_ip)) in enumerate(zip(sizes, times)):
        w = wrong if i == len(sizes) - 1 else 0
        a1, a2 = size / max(t_oop, 1e-3) / 1e3, size / max(t_ip, 1e-3) / 1e3
        rows.append((size, size // 4, t_oop, a1, a1 * factor, w, t_ip, a2, a2 * factor, w))
    return rows


ENV_PREFIXES = ("NCCL_", "FI_", "TORCH_NCCL_", "OFI_NCCL_")


def record_env(env_dir: str, node: str, rank: int, env: dict[str, str]) -> None:
    """What this rank was started with, for a test to read (`<env_dir>/<node>.<rank>.json`)."""
    seen = {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)}
    Path(env_dir).mkdir(parents=True, exist_ok=True)
    Path(env_dir, f"{node}.{rank}.json").write_text(json.dumps(seen, sort_keys=True))


def _jitter(key: str) -> float:
    """Deterministic +-0.4% so tables look measured, not computed."""
    h = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
    return 1.0 + ((h % 801) - 400) / 100000.0


def simulate_rows(peak_busbw: float, ranks: int, sizes: list[int], seed: str, wrong: int = 0
                  ) -> list[tuple[int, int, float, float, float, int, float, float, float, int]]:
    factor = 2.0 * (ranks - 1) / ranks if ranks > 1 else 0.0
    # a single rank has no bus: nccl-tests reports busbw 0; keep algbw meaningful
    peak_algbw = peak_busbw / factor if factor else peak_busbw
    rows = []
    for i, size in enumerate(sizes):
        out = []
        for place in ("oop", "ip"):
            t_us = (LATENCY_US + size / (peak_algbw * 1e3)) * _jitter(f"{seed}:{size}:{place}")
            algbw = size / t_us / 1e3
            out.append((t_us, algbw, algbw * factor))
        w = wrong if i == len(sizes) - 1 else 0
        rows.append((size, size // 4, *out[0], w, *out[1], w))
    return rows


def _fmt(v: float, width: int) -> str:
    for nd in (2, 1, 0):
        s = f"{v:{width}.{nd}f}"
        if len(s) <= width:
            return s
    return f"{v:{width}.1e}"


def render_text(nodes: list[str], gpus: int, rows: list[tuple[Any, ...]], args: argparse.Namespace) -> str:
    lines = [f"# nccl-tests version {NCCL_TESTS_VERSION} nccl-headers={NCCL_CODE} nccl-library={NCCL_CODE}",
             "# Collective test starting: all_reduce_perf",
             f"# nThread 1 nGpus {max(1, args.g)} minBytes {args.min} maxBytes {args.max} step: {args.f}(factor) warmup iters: "
             f"{args.w} iters: {args.n} agg iters: 1 validation: {args.c} graph: 0",
             "#", "# Using devices"]
    rank = 0
    for n_i, node in enumerate(nodes):
        for g in range(gpus):
            bus = ["53", "64", "75", "86", "97", "a8", "b9", "ca"][g % 8]
            lines.append(f"#  Rank {rank:2d} Group  0 Pid {10000 + n_i:6d} on {node:>10} device {g:2d} "
                         f"[0000:{bus}:00] NVIDIA H100 80GB HBM3")
            rank += 1
    lines += ["#",
              "#                                                              out-of-place                       in-place          ",
              "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
              "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       "]
    total_wrong = 0
    busbws = []
    for (size, count, t1, a1, b1, w1, t2, a2, b2, w2) in rows:
        lines.append(f"{size:12d}  {count:12d}  {'float':>8}  {'sum':>6}  {-1:6d}  {_fmt(t1, 7)}  {_fmt(a1, 6)}  "
                     f"{_fmt(b1, 6)}  {w1:6g}  {_fmt(t2, 7)}  {_fmt(a2, 6)}  {_fmt(b2, 6)}  {w2:6g}")
        total_wrong += w1 + w2
        busbws.append(b1)
    lines += [f"# Out of bounds values : {total_wrong} {'FAILED' if total_wrong else 'OK'}",
              f"# Avg bus bandwidth    : {sum(busbws) / max(1, len(busbws)):g} ", "#",
              "# Collective test concluded: all_reduce_perf", ""]
    return "\n".join(lines)


def render_json(nodes: list[str], gpus: int, rows: list[tuple[Any, ...]], args: argparse.Namespace) -> str:
    """The `-J` file layout of nccl-tests src/util.cu (JSON_FILE_VERSION 3)."""
    results = [{"size": r[0], "count": r[1], "type": "float", "redop": "sum", "root": f"{-1:6d}",
                "out_of_place": {"time": r[2], "alg_bw": r[3], "bus_bw": r[4], "nwrong": float(r[5])},
                "in_place": {"time": r[6], "alg_bw": r[7], "bus_bw": r[8], "nwrong": float(r[9])},
                "actual_iterations": args.n, "experiment_name": "AllReduce"} for r in rows]
    wrong = sum(r[5] + r[9] for r in rows)
    doc = {"version": 3, "start_time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": sys.argv, "env": [],
           "nccl_version": NCCL_CODE,
           "config": {"nthreads": 1, "ngpus": gpus, "minimum_bytes": args.min, "maximum_bytes": args.max,
                      "step_factor": args.f, "iterations": args.n, "warmup_iters": args.w,
                      "devices": [{"rank": i * gpus + g, "hostname": n, "device": g} for i, n in enumerate(nodes)
                                  for g in range(gpus)]},
           "results": results, "out_of_bounds": {"count": wrong, "okay": "true" if not wrong else "false"},
           "average_bus_bandwidth": {"bandwidth": sum(r[4] for r in rows) / max(1, len(rows)), "okay": "unchecked"},
           "errors": []}
    return json.dumps(doc, separators=(",", ":"))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="all_reduce_perf (gpuguard simulation)", add_help=True)
    ap.add_argument("-b", "--minbytes", dest="min", default="32M")
    ap.add_argument("-e", "--maxbytes", dest="max", default="32M")
    ap.add_argument("-f", "--stepfactor", dest="f", type=int, default=2)
    ap.add_argument("-g", "--ngpus", dest="g", type=int, default=1)
    ap.add_argument("-t", "--nthreads", dest="t", type=int, default=1)
    ap.add_argument("-n", "--iters", dest="n", type=int, default=20)
    ap.add_argument("-w", "--warmup_iters", dest="w", type=int, default=5)
    ap.add_argument("-c", "--check", dest="c", type=int, default=1)
    ap.add_argument("-J", "--output_json", dest="json", default=None)
    ap.add_argument("--scenario-dir", default=None, help=f"default ${ENV_SCENARIO_DIR}")
    args, _unknown = ap.parse_known_args(argv)
    try:
        args.min, args.max = parse_size(str(args.min)), parse_size(str(args.max))
    except ValueError as e:
        print(f"all_reduce_perf: {e}", file=sys.stderr)
        return 1
    env = dict(os.environ)
    scenario_dir = args.scenario_dir or env.get(ENV_SCENARIO_DIR)
    nodes = job_nodes(env)
    specs = {n: node_nccl_spec(scenario_dir, n) for n in nodes}
    rank = int(env.get("SLURM_PROCID", "0") or 0)
    here = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    env_dir = next((str(s["env_dir"]) for s in specs.values() if s.get("env_dir")), None)
    if env_dir:
        record_env(env_dir, here, rank, env)
    hang = max((float(s.get("hang_s", 0)) for s in specs.values()), default=0.0)
    if hang:
        time.sleep(hang)
    failing = [s["fail"] for s in specs.values() if s.get("fail")]
    if failing:
        if rank == 0:
            host = env.get("SLURMD_NODENAME", "node")
            print(f"{host}:{os.getpid()}:{os.getpid()} [0] {failing[0]}", file=sys.stderr)
            print(f"{host}: Test NCCL failure common.cu:1005 'unhandled system error'", flush=True)
        return 2
    try:
        rows, per_node = table_rows(env, specs, nodes, rank, args)
    except (RingError, OSError) as e:  # a ring that cannot form or breaks: a failed collective, as NCCL says
        print(f"{here}:{os.getpid()}:{os.getpid()} [{rank}] NCCL WARN NET/Socket : {e}", file=sys.stderr)
        print(f"{here}: Test NCCL failure common.cu:1005 'remote process exited or there was a network error'",
              flush=True)
        return 2
    if rank != 0:  # like an MPI build: only rank 0 prints
        return 0
    sys.stdout.write(render_text(nodes, per_node, rows, args))
    sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(render_json(nodes, max(1, args.g), rows, args))
    return 0


def table_rows(env: dict[str, str], specs: dict[str, dict[str, Any]], nodes: list[str], rank: int,
               args: argparse.Namespace) -> tuple[list[tuple[Any, ...]], int]:
    """(the table's rows, ranks per node): measured over TCP when a node's scenario says `measure: tcp` (raises
    when the ring cannot be formed or breaks), else computed from the scenarios."""
    sizes, s = [], max(1, args.min)
    while s <= args.max:
        sizes.append(s)
        s *= max(2, args.f)
    wrong = max(int(s.get("wrong", 0)) for s in specs.values())
    # MPI ranks = Slurm tasks (one per GPU with -g 1, one per node with -g 8) x GPUs per task
    tasks = int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or len(nodes))
    per_node = max(1, tasks // max(1, len(nodes))) * max(1, args.g) * max(1, args.t)
    ranks = len(nodes) * per_node
    if any(str(s.get("measure", "")) == "tcp" for s in specs.values()):
        return measured_rows(measure_tcp(env, nodes, tasks, rank, sizes, args), ranks, sizes, wrong=wrong), per_node
    return simulate_rows(min(node_busbw(specs[n]) for n in nodes), ranks, sizes, seed=",".join(nodes),
                         wrong=wrong), per_node


def measure_tcp(env: dict[str, str], nodes: list[str], tasks: int, rank: int, sizes: list[int],
                args: argparse.Namespace) -> list[tuple[float, float]]:
    """This rank's part of the measured run: the step's ring over TCP (devtools.nccl_ring), timed per size."""
    from devtools.nccl_ring import Ring, node_addrs, ring_port, time_sizes

    per_node = max(1, tasks // max(1, len(nodes)))
    world = len(nodes) * per_node
    addrs = node_addrs(nodes)
    job, step = env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", "0")
    ring = Ring.form(rank, world, [addrs[nodes[r // per_node]] for r in range(world)],
                     [ring_port(job, step, r) for r in range(world)])
    try:
        return time_sizes(ring, sizes, args.w, args.n)
    finally:
        ring.close()


# --------------------------------------------------------------------------- simulated dcgmi

_DCGM_TESTS = [("Deployment", "software"), ("Hardware", "memory"), ("Integration", "pcie"),
               ("Hardware", "diagnostic"), ("Stress", "targeted_stress"), ("Stress", "targeted_power")]


def dcgmi_document(spec: dict[str, Any], level: int, gpus: list[int]) -> dict[str, Any]:
    """A DCGM 4.x `dcgmi diag -j` document from a scenario's `dcgm:` mapping:

        dcgm: {fail: [{test: memory, gpu: 3, severity: 6, message: "..."}], warn: [...]}

    (severity: dcgm_errors.h, 6 RESET, 2 ISOLATE, 5 CONFIG ...). Level 1 runs the software test only, level 2
    adds memory and pcie, 3+ the rest, as dcgmi does."""
    names = _DCGM_TESTS[:1] if level <= 1 else _DCGM_TESTS[:3] if level == 2 else _DCGM_TESTS
    bad: dict[tuple[str, int], tuple[str, dict[str, Any]]] = {}
    for status in ("warn", "fail"):
        for item in spec.get(status) or []:
            bad[(str(item.get("test")), int(item.get("gpu", 0)))] = (status, item)
    cats: dict[str, list[dict[str, Any]]] = {}
    for cat, test in names:
        results, worst = [], "Pass"
        for g in gpus:
            r: dict[str, Any] = {"entity_group": "GPU", "entity_group_id": 1, "entity_id": g, "status": "Pass"}
            if (test, g) in bad:
                status, item = bad[(test, g)]
                r["status"] = "Fail" if status == "fail" else "Warn"
                r["warnings"] = [{"error_category": 0, "error_id": int(item.get("error_id", 0)),
                                  "error_severity": int(item.get("severity", 4)),
                                  "warning": str(item.get("message", f"{test} failed on GPU {g}"))}]
                worst = "Fail" if r["status"] == "Fail" or worst == "Fail" else "Warn"
            results.append(r)
        cats.setdefault(cat, []).append({"name": test, "results": results, "test_summary": {"status": worst}})
    return {"DCGM Diagnostic": {"test_categories": [{"category": c, "tests": t} for c, t in cats.items()]},
            "entity_groups": [{"entity_group": "GPU", "entity_group_id": 1,
                               "entities": [{"entity_id": g} for g in gpus]}],
            "metadata": {"version": "4.2.3", "Driver Version Detected": "550.90.07"}}


def dcgmi_main(argv: list[str]) -> int:
    """`dcgmi diag -r N -j [-i GPUS]` over the node's scenario (`dcgm:` key). `dcgm: {error: "..."}` = the host
    engine is not reachable; `dcgm: {hang_s: N}` hangs."""
    ap = argparse.ArgumentParser(prog="dcgmi (gpuguard simulation)")
    ap.add_argument("cmd", choices=("diag",))
    ap.add_argument("-r", dest="level", default="1")
    ap.add_argument("-j", dest="json", action="store_true")
    ap.add_argument("-i", dest="gpus", default=None)
    ap.add_argument("--scenario-dir", default=None)
    args = ap.parse_args(argv)
    env = dict(os.environ)
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    spec = node_scenario_key(args.scenario_dir or env.get(ENV_SCENARIO_DIR), node, "dcgm")
    if spec.get("hang_s"):
        time.sleep(float(spec["hang_s"]))
    if spec.get("error"):
        print(f"Error: {spec['error']}", file=sys.stderr)
        return 255
    level = {"short": 1, "medium": 2, "long": 3}.get(args.level, None) or int(args.level)
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(int(spec.get("gpus", 8))))
    doc = dcgmi_document(spec, level, gpus)
    print(json.dumps(doc, indent="\t"))
    failed = any(r["status"] == "Fail" for c in doc["DCGM Diagnostic"]["test_categories"] for t in c["tests"]
                 for r in t["results"])
    return 226 if failed else 0


def install_stub(dest_dir: str, scenario_dir: str, python: Optional[str] = None,
                 name: str = "all_reduce_perf", tool: str = "nccl") -> Path:
    """Write an executable `<dest_dir>/<name>` that runs this simulator against `scenario_dir` (a directory of
    `<node>.yaml`, or one scenario file): tool="nccl" for all_reduce_perf, tool="dcgmi" for dcgmi."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / name
    py = python or sys.executable
    mode = " --dcgmi" if tool == "dcgmi" else ""
    text = (f"#!/bin/sh\n# gpuguard simulation: {'dcgmi' if mode else 'nccl-tests ' + name} over simulated nodes\n"
            f"{ENV_SCENARIO_DIR}={shlex.quote(str(scenario_dir))}\nexport {ENV_SCENARIO_DIR}\n"
            f"PYTHONPATH={shlex.quote(str(REPO_ROOT))}; export PYTHONPATH\n"  # devtools/ is not installed
            f"exec {shlex.quote(py)} -m devtools.nccl_tests_stub{mode} \"$@\"\n")
    try:
        if path.read_text() == text and os.access(path, os.X_OK):
            return path  # already there (every simulated run asks)
    except OSError:
        pass
    path.write_text(text)
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--dcgmi"]:
        sys.exit(dcgmi_main(sys.argv[2:]))
    sys.exit(main())
