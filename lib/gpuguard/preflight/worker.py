"""One persistent pre-flight worker per node: `srun -N1 -w NODE python -m gpuguard.preflight.worker --coordinator
ADDR:PORT` imports torch once (seconds of CPU: the cost that used to be paid again by every round), says hello to
the coordinator (`gpuguard preflight` on the batch node, gpuguard.preflight.pool) and then runs each collective it
is sent in a forked child: a group's rank 0 hosts that group's rendezvous (a torch TCPStore on a port the kernel
picks, reported back so that the other ranks dial it), every rank runs the all_reduce sizes, rank 0 reports the bus
bandwidth. A child the coordinator gives up on (a hung collective) is killed; the worker itself stays ready for the
next round. torch is imported here only (gpuguard[probe]).

A rank is its node's place in the group the coordinator sends (never SLURM_PROCID). gloo picks the address it
announces by resolving the host name, which stock Debian maps to 127.0.1.1: unless the job chose GLOO_SOCKET_IFNAME
/ NCCL_SOCKET_IFNAME, the interface that carries this node's route to the coordinator is used."""

from __future__ import annotations

import argparse
import datetime
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable, Optional

from gpuguard.preflight.protocol import SIZE_FACTOR, LineReader, encode
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


def runqueue_wait_s() -> Optional[float]:
    """Seconds this process's threads have spent runnable but waiting for a CPU (/proc/self/task/*/schedstat, its
    second field), or None where the kernel does not say."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread gone meanwhile
    except OSError:
        return None
    return total / 1e9


def time_sizes(torch: Any, dist: Any, device: Any, byte_sizes: list[int], iters: int,
               sync: Callable[[], None]) -> tuple[list[float], Optional[float]]:
    """Bus bandwidth (GB/s) per size: the slowest rank's mean time per all_reduce; and the largest share of the
    largest size's timed loop any rank spent waiting for a CPU (a starved machine, not a slow link; None: unknown)."""
    from gpuguard.nccl.torch_probe import bus_factor

    world = dist.get_world_size()
    out = []
    starved: Optional[float] = None
    for size in byte_sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm-up
        sync()
        w0 = runqueue_wait_s()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        wall = time.perf_counter() - t0
        w1 = runqueue_wait_s()
        share = (w1 - w0) / wall if w0 is not None and w1 is not None and wall > 0 else -1.0
        t = torch.tensor([wall / iters, share], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(round(size / float(t[0].item()) / 1e9 * bus_factor(world), 6))
        starved = round(float(t[1].item()), 3) if float(t[1].item()) >= 0 else None
    return out, starved


def run_collective(torch: Any, dist: Any, job: dict[str, Any], say: Callable[[dict[str, Any]], None]) -> None:
    """One group's collective (in the forked child): rendezvous, the sizes, rank 0's result."""
    from gpuguard.nccl.torch_probe import sizes

    rank, world = int(job["rank"]), int(job["world"])
    timeout = datetime.timedelta(seconds=float(job.get("timeout", 15)))
    backend = job.get("backend") or "gloo"
    store = dist.TCPStore(job["master"], int(job.get("port") or 0), world, rank == 0, timeout=timeout,
                          wait_for_workers=False)
    if rank == 0:
        say({"port": store.port})
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    byte_sizes = sizes(int(job["min_bytes"]), int(job["max_bytes"]), SIZE_FACTOR)
    busbw, starved = time_sizes(torch, dist, device, byte_sizes, int(job["iters"]),
                                (lambda: torch.cuda.synchronize(device)) if backend == "nccl" else (lambda: None))
    if rank == 0:
        say({"result": {"sizes": byte_sizes, "busbw_gbps": busbw, "backend": backend, "world": world,
                        "starved": starved}})
    dist.destroy_process_group()


class Server:
    """The worker's loop: commands from the coordinator in, each collective in a child, its lines relayed back."""

    def __init__(self, sock: socket.socket, torch: Any, dist: Any) -> None:
        self.sock = sock
        self.torch, self.dist = torch, dist
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.children: dict[str, tuple[int, int, LineReader]] = {}  # gid -> (pid, read fd, reader)

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def loop(self) -> int:
        reader = LineReader()
        while True:
            for key, _ in self.sel.select(timeout=1.0):
                if key.data is None:
                    data = self.sock.recv(65536)
                    if not data:
                        return self.quit()
                    for msg in reader.feed(data):
                        if self.command(msg):
                            return self.quit()
                else:
                    self.child_output(key.data)

    def command(self, msg: dict[str, Any]) -> bool:
        op = msg.get("op")
        if op == "exit":
            return True
        if op == "abort":
            self.kill(str(msg.get("gid")))
        elif op == "run":
            self.fork(msg)
        return False

    def fork(self, job: dict[str, Any]) -> None:
        gid = str(job["gid"])
        self.kill(gid)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the loop
            os.close(r)
            code = 0
            try:
                self.sock.close()
                run_collective(self.torch, self.dist, job,
                               lambda m: os.write(w, encode(m)))
            except BaseException as e:  # noqa: BLE001 - the coordinator gets whatever went wrong, as evidence
                try:
                    os.write(w, encode({"error": f"{type(e).__name__}: {e}"[:300]}))
                except OSError:
                    pass
                code = 1
            os._exit(code)
        os.close(w)
        self.children[gid] = (pid, r, LineReader())
        self.sel.register(r, selectors.EVENT_READ, gid)

    def child_output(self, gid: str) -> None:
        pid, fd, reader = self.children[gid]
        data = os.read(fd, 65536)
        if data:
            for msg in reader.feed(data):
                self.send({**msg, "gid": gid})
            return
        self.sel.unregister(fd)
        os.close(fd)
        _, status = os.waitpid(pid, 0)
        del self.children[gid]
        self.send({"gid": gid, "ended": os.waitstatus_to_exitcode(status)})

    def kill(self, gid: str) -> None:
        if gid not in self.children:
            return
        pid, fd, _ = self.children.pop(gid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.sel.unregister(fd)
        os.close(fd)
        os.waitpid(pid, 0)

    def quit(self) -> int:
        for gid in list(self.children):
            self.kill(gid)
        self.sock.close()
        sys.stdout.flush()
        os._exit(0)  # no interpreter teardown (torch's takes a second of CPU): the job is waiting


def serve(coordinator: str, node: str, token: str) -> int:
    t0 = time.monotonic()
    host, port = coordinator.rsplit(":", 1)
    if not os.environ.get("GLOO_SOCKET_IFNAME") or not os.environ.get("NCCL_SOCKET_IFNAME"):
        dev = route_ifname(host)
        if dev:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", dev)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", dev)
    import torch
    import torch.distributed as dist

    import_s = time.monotonic() - t0
    sock = socket.create_connection((host, int(port)), timeout=10.0)
    sock.settimeout(None)
    addr = sock.getsockname()[0]
    server = Server(sock, torch, dist)
    server.send({"op": "hello", "node": node, "token": token, "addr": addr, "import_s": round(import_s, 2),
                 "cuda": bool(torch.cuda.is_available())})
    return server.loop()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuguard.preflight.worker")
    ap.add_argument("--coordinator", required=True, help="ADDR:PORT of `gpuguard preflight` on the batch node")
    ap.add_argument("--node", default=os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    ap.add_argument("--token", default="", help="the pre-flight run this worker belongs to")
    args = ap.parse_args(argv)
    try:
        return serve(args.coordinator, args.node, args.token)
    except (OSError, KeyboardInterrupt) as e:
        print(f"gpuguard preflight worker on {args.node}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
