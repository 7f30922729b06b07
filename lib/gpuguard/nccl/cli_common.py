"""Helpers shared by the `nccl`, `efa`, `dcgm` and `baseline` commands (gpuguard.nccl.*_cli)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

from gpuguard.siteconfig import load_config
from gpuguard.nccl.sweep import JobSpec, SlurmRunner, SweepError, default_workdir, partition_nodes
from gpuguard.nccl.table import parse_size
from gpuguard.slurm.hostlist import HostlistError, expand_hostlist


def parse_size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partition", help="Slurm partition (nodes default to its usable nodes)")
    p.add_argument("--nodes", help="hostlist to sweep, e.g. node[1-16] (default: the partition's usable nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default nccl.sweep_gpus_per_node)")
    p.add_argument("--binary", help="all_reduce_perf on the compute nodes (default nccl.sweep_binary / nccl.binary)")
    p.add_argument("--min-bytes", type=parse_size_arg, help="smallest message, e.g. 1G (default nccl.sweep_min_bytes)")
    p.add_argument("--max-bytes", type=parse_size_arg, help="largest message, e.g. 16G (default nccl.sweep_max_bytes)")
    p.add_argument("--iters", type=int, help="iterations per size (default nccl.sweep_iterations)")
    p.add_argument("--time-limit", help="job time limit [D-]HH:MM:SS (default nccl.sweep_time_limit)")
    p.add_argument("--profile", help="profile the baseline samples are filed under (default node.profile)")
    p.add_argument("--workdir", help="directory for job scripts and outputs, on a filesystem the nodes share")
    p.add_argument("--job-timeout", type=float, help="seconds a round of jobs may take (default nccl.sweep_job_timeout_s)")


def read_input(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def say(msg: str, t0: float = time.monotonic()) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def load_cfg(args: argparse.Namespace) -> Any:
    return load_config(getattr(args, "config", None))


def history_path(cfg: Any) -> str:
    n = cfg.nccl
    return n.history_path or cfg.store.path_for("fleet")


def profile_of(cfg: Any, explicit: Optional[str]) -> str:
    if explicit:
        return explicit
    name = cfg.node.profile
    return "generic" if name == "auto" else str(name)


def sweep_spec(n: Any, partition: Optional[str] = None, gpus_per_node: Optional[int] = None,
               binary: Optional[str] = None) -> JobSpec:
    """The sweep's nccl-tests settings from the `nccl:` section (what `gpuguard preflight` runs with nccl-tests too):
    binary (nccl.sweep_binary, else nccl.binary), GPUs per node, srun --mpi plugin, preset."""
    return JobSpec(partition=partition, gpus_per_node=gpus_per_node or n.sweep_gpus_per_node,
                   binary=binary or n.sweep_binary or n.binary, min_bytes=n.sweep_min_bytes,
                   max_bytes=n.sweep_max_bytes, iterations=n.sweep_iterations, time_limit=n.sweep_time_limit,
                   preset=n.sweep_preset, mpi=n.sweep_mpi)


def runner_from(args: argparse.Namespace, cfg: Any, threshold_for: Any, store_path: str) -> Any:
    n = cfg.nccl
    spec = sweep_spec(n, args.partition, args.gpus_per_node, args.binary)
    spec.min_bytes, spec.max_bytes = args.min_bytes or n.sweep_min_bytes, args.max_bytes or n.sweep_max_bytes
    spec.iterations, spec.time_limit = args.iters or n.sweep_iterations, args.time_limit or n.sweep_time_limit
    if spec.max_bytes < spec.min_bytes:
        raise ValueError(f"--max-bytes {spec.max_bytes} is below --min-bytes {spec.min_bytes}")
    workdir = args.workdir or n.sweep_workdir or default_workdir(store_path)
    if n.sweep_workdir and not args.workdir:
        workdir = os.path.join(workdir, time.strftime("%Y%m%d-%H%M%S"))
    return SlurmRunner(spec, workdir, threshold_for, job_timeout_s=args.job_timeout or n.sweep_job_timeout_s,
                       progress=say)


def nodes_from(args: argparse.Namespace) -> list[str]:
    if args.nodes:
        try:
            return expand_hostlist(args.nodes)
        except HostlistError as e:
            raise ValueError(f"--nodes: {e}") from None
    if not args.partition:
        raise ValueError("give --partition and/or --nodes")
    try:
        nodes, skipped = partition_nodes(args.partition)
    except SweepError as e:
        raise ValueError(str(e)) from None
    for name, state in skipped.items():
        say(f"skipping {name}: {state}")
    return nodes


def largest_size(min_bytes: int, max_bytes: int) -> int:
    size = min_bytes
    while size * 2 <= max_bytes:
        size *= 2
    return size
