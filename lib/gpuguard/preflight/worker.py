"""One rank of a pre-flight collective: `srun --ntasks-per-node=1 python -m gpuguard.preflight.worker --master
ADDR:PORT --group NODE,NODE ...` runs one per node. A rank is its node's place in --group (never SLURM_PROCID: Slurm
numbers the tasks in the allocation's node order, so in a group such as node4,node2 rank 0 would run on node2 while
everyone dials node4, and the run hangs); rank 0 hosts the rendezvous (torch's TCP store) on the group's first
node, the master, and prints the tagged result line (gpuguard.preflight.judge). torch is imported here only (gpuguard[probe]).

gloo picks the address it announces by resolving the host name, which stock Debian maps to 127.0.1.1: unless the
job chose GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, the interface that carries this node's route to the master is
used (the torchrun template does the same in shell)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any, Optional

from gpuguard.nccl.torch_probe import bus_factor, sizes
from gpuguard.preflight.judge import result_line
from gpuguard.util.toolrun import run_tool


def route_ifname(addr: str) -> Optional[str]:
    """The interface this node reaches `addr` through (the one holding `addr` when it is this node's own)."""
    r = run_tool(["ip", "-o", "route", "get", addr], 3.0)
    words = r.text().split() if r.ok else []
    dev = words[words.index("dev") + 1] if "dev" in words[:-1] else None
    if dev == "lo":
        mine = run_tool(["ip", "-o", "addr", "show", "to", addr], 3.0)
        parts = mine.text().split() if mine.ok else []
        dev = parts[1] if len(parts) > 1 else None
    return dev


def time_sizes(torch: Any, dist: Any, device: Any, byte_sizes: list[int], iters: int,
               sync: Any) -> list[float]:
    """Bus bandwidth (GB/s) per size: the slowest rank's mean time per all_reduce."""
    world = dist.get_world_size()
    out = []
    for size in byte_sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm-up
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(round(size / float(t.item()) / 1e9 * bus_factor(world), 6))
    return out


def rank_and_world(group: str, env: Any) -> tuple[int, int]:
    """This task's rank (its node's place in the group: the master's is 0) and the world size."""
    nodes = [n for n in group.split(",") if n]
    here = env.get("SLURMD_NODENAME", "")
    if here in nodes:
        return nodes.index(here), len(nodes)
    return int(env.get("SLURM_PROCID", "0")), int(env.get("SLURM_NTASKS", "1"))


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = rank_and_world(args.group, os.environ)
    addr, port = args.master.rsplit(":", 1)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not os.environ.get("GLOO_SOCKET_IFNAME") or not os.environ.get("NCCL_SOCKET_IFNAME"):
        dev = route_ifname(addr)
        if dev:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", dev)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", dev)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    byte_sizes = sizes(args.min_bytes, args.max_bytes, 4)
    busbw = time_sizes(torch, dist, device, byte_sizes, args.iters,
                       (lambda: torch.cuda.synchronize(device)) if backend == "nccl" else (lambda: None))
    if rank == 0:
        print(result_line(byte_sizes, busbw, backend, world), flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuguard.preflight.worker")
    ap.add_argument("--master", required=True, help="ADDR:PORT of the group's first node")
    ap.add_argument("--group", default="", help="the group's nodes, master first (ranks in this order)")
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    ap.add_argument("--min-bytes", type=int, default=65536)
    ap.add_argument("--max-bytes", type=int, default=4194304)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=15.0)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
