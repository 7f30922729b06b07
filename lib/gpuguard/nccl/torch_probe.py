"""Fallback bandwidth probe where nccl-tests is not installed: a torch.distributed all_reduce sweep.

    python -m gpuguard.nccl.torch_probe --nprocs 8 [--backend auto|nccl|gloo] [--min-bytes N --max-bytes N]

The launcher (this module's `main`) never imports torch: it starts `--nprocs` worker processes (this module
with `--worker`, one per GPU with the NCCL backend; plain CPU processes with gloo), each joining a process
group over TCP on 127.0.0.1, and relays rank 0's output. Rank 0 prints an nccl-tests style table, so
`gpuguard.nccl.parse` reads it and the report has the same shape as an nccl-tests run:

- algbw = bytes / time, busbw = algbw * 2(n-1)/n (nccl-tests' all_reduce bus bandwidth factor), time the
  slowest rank's mean per iteration;
- `#wrong`: each rank contributes (rank+1) everywhere, every element must then be n(n+1)/2;
- torch's all_reduce works in place: the figures go in the out-of-place columns (the ones health decisions
  read), the in-place columns print N/A.

Exit codes: 0 ok, 1 a worker failed, 2 usage, 3 torch not installed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import subprocess
import sys
import time
from typing import Any, Optional


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    out = []
    size = max(4, min_bytes)
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


def bus_factor(n: int) -> float:
    """nccl-tests' all_reduce busbw factor 2(n-1)/n."""
    return 2.0 * (n - 1) / n if n > 0 else 0.0


def format_row(size: int, count: int, time_us: float, algbw: float, busbw: float, wrong: int) -> str:
    return (f"{size:12d}  {count:12d}  {'float':>8}  {'sum':>6}  {-1:6d}  {time_us:7.1f}  {algbw:6.2f}  "
            f"{busbw:6.2f}  {wrong:6d}  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}")


def header(backend: str, world: int, min_bytes: int, max_bytes: int, warmup: int, iters: int,
           devices: list[str]) -> list[str]:
    lines = [f"# gpuguard torch.distributed all_reduce probe: backend {backend}, world size {world}",
             "# Collective test starting: torch_all_reduce",
             f"# nThread 1 nGpus 1 minBytes {min_bytes} maxBytes {max_bytes} step: 2(factor) warmup iters: {warmup} "
             f"iters: {iters} agg iters: 1 validation: 1 graph: 0",
             "#", "# Using devices"]
    lines += devices
    lines += ["#",
              "#                                                              out-of-place                       in-place",
              "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
              "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"]
    return lines


# --------------------------------------------------------------------------- worker (imports torch)


def worker(args: argparse.Namespace) -> int:
    import torch  # optional dependency (gpuguard[probe]): only the probe's worker processes import it
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, _rank_line(torch, backend, rank))
    if rank == 0:
        print("\n".join(header(backend, world, args.min_bytes, args.max_bytes, args.warmup, args.iters,
                               [str(g) for g in gathered])), flush=True)
    busbws: list[float] = []
    wrong_total = 0
    for size in sizes(args.min_bytes, args.max_bytes):
        count = size // 4
        t, wrong = _time_all_reduce(torch, dist, backend, device, count, rank, world, args.warmup, args.iters)
        algbw = size / t / 1e9
        busbw = algbw * bus_factor(world)
        busbws.append(busbw)
        wrong_total += wrong
        if rank == 0:
            print(format_row(size, count, t * 1e6, algbw, busbw, wrong), flush=True)
    if rank == 0:
        print(f"# Out of bounds values : {wrong_total} {'FAILED' if wrong_total else 'OK'}")
        print(f"# Avg bus bandwidth    : {sum(busbws) / max(1, len(busbws)):g} ")
        print("#")
        print("# Collective test concluded: torch_all_reduce", flush=True)
    dist.destroy_process_group()
    return 0


def _rank_line(torch: Any, backend: str, rank: int) -> str:
    """This rank's `# Rank N ... device N [bus] name` line, as nccl-tests prints it."""
    if backend == "nccl":
        name = torch.cuda.get_device_name(rank)
        props = torch.cuda.get_device_properties(rank)
        bus = getattr(props, "pci_bus_id", None)
        return f"#  Rank {rank:2d} Group  0 Pid {os.getpid():6d} on {socket.gethostname():>10} device {rank:2d} [{bus or '0x00'}] {name}"
    return f"#  Rank {rank:2d} Group  0 Pid {os.getpid():6d} on {socket.gethostname():>10} device {rank:2d} [cpu] gloo"


def _time_all_reduce(torch: Any, dist: Any, backend: str, device: Any, count: int, rank: int, world: int,
                     warmup: int, iters: int) -> tuple[float, int]:
    """(seconds per all_reduce of `count` floats, slowest rank; wrong values summed over the ranks)."""

    def sync() -> None:
        if backend == "nccl":
            torch.cuda.synchronize(device)

    buf = torch.ones(count, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(buf)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    check = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(check)
    expected = world * (world + 1) / 2.0
    wrong = torch.tensor([int((check != expected).sum().item())], dtype=torch.int64, device=device)
    dist.all_reduce(wrong)
    return float(elapsed.item()), int(wrong.item())


# --------------------------------------------------------------------------- launcher (no torch import)


def launch(nprocs: int, argv_tail: list[str], timeout_s: float) -> int:
    if importlib.util.find_spec("torch") is None:
        print("gpuguard torch probe: torch is not installed", file=sys.stderr)
        return 3
    port = _free_port()
    procs: list[subprocess.Popen[str]] = []
    base_env = dict(os.environ)
    for rank in range(nprocs):
        env = {**base_env, "RANK": str(rank), "WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": base_env.get("OMP_NUM_THREADS", "1")}
        procs.append(subprocess.Popen([sys.executable, "-m", "gpuguard.nccl.torch_probe", "--worker", *argv_tail],
                                      env=env, stdin=subprocess.DEVNULL,
                                      stdout=None if rank == 0 else subprocess.DEVNULL,
                                      stderr=None if rank == 0 else subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout_s
    rc = 0
    for p in procs:
        try:
            code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print(f"gpuguard torch probe: timed out after {timeout_s:g}s", file=sys.stderr)
            return 1
        if code != 0:
            rc = 1
            if p.stderr is not None:
                tail = (p.stderr.read() or "").strip().splitlines()[-3:]
                print(f"gpuguard torch probe: a worker failed ({code}): {' | '.join(tail)}", file=sys.stderr)
    return rc


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuguard.nccl.torch_probe",
                                 description="torch.distributed all_reduce bandwidth probe (nccl-tests style output)")
    ap.add_argument("--nprocs", type=int, default=2, help="processes (one per GPU with NCCL); default 2")
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                    help="auto: NCCL when there are enough GPUs, else gloo on CPU")
    ap.add_argument("--min-bytes", type=int, default=1048576)
    ap.add_argument("--max-bytes", type=int, default=67108864)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole probe")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.nprocs < 1 or args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.iters < 1:
        print("gpuguard torch probe: need --nprocs >= 1, 4 <= --min-bytes <= --max-bytes, --iters >= 1",
              file=sys.stderr)
        return 2
    if args.worker:
        return worker(args)
    tail = ["--backend", args.backend, "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
            "--iters", str(args.iters), "--warmup", str(args.warmup), "--timeout", str(args.timeout)]
    return launch(args.nprocs, tail, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
