"""The measured mode of the simulated nccl-tests (devtools.nccl_tests_stub, scenario `nccl: {measure: tcp}`): every
rank of the srun step really moves the bytes of a ring all_reduce to its neighbours over TCP, between the nodes'
own addresses, so that a slow link (a `tc tbf` on a namespaced node's veth) really shows as low bus bandwidth.

Ranks are laid out as srun's default block distribution places them (rank r on node r // ranks_per_node); each
listens on `ring_port(job, step, rank)` (distinct per step and rank, so concurrent steps of one node never meet)
and finds its successor's node at that node's `NodeAddr` (`scontrol show node -o`, one bounded call). One
all_reduce of S bytes is NCCL's ring: 2 (W - 1) steps, each sending S / W bytes to the next rank while receiving as
much from the previous one; a rank's time per iteration is what nccl-tests reports, busbw = S / t * 2 (W - 1) / W.
The bytes are moved, not summed (the scenario's `wrong` still says whether the result is wrong)."""

from __future__ import annotations

import selectors
import socket
import struct
import subprocess
import time
from typing import Optional

CONNECT_S = 30.0  # how long the ranks may take to find each other (srun starts them within a second or two)
IO_S = 120.0  # one step of the ring: a link that moves nothing for this long is a failed collective


class RingError(RuntimeError):
    """The ring could not be formed or broke (NCCL's `remote process exited or there was a network error`)."""


def ring_port(job_id: str, step_id: str, rank: int) -> int:
    """The TCP port rank `rank` of step `job.step` listens on (pure): 20000-59999, one per (job, step, rank)."""
    try:
        job, step = int(job_id or 0), int(step_id or 0)
    except ValueError:
        job, step = 0, 0
    return 20000 + (job * 7919 + step * 257) % 38000 + rank


def node_addrs(nodes: list[str], scontrol: str = "scontrol", timeout_s: float = 10.0) -> dict[str, str]:
    """node -> NodeAddr from one `scontrol show node -o`; a node Slurm does not know is dialled by its name."""
    from gpuguard.slurm.parse import parse_node_lines

    try:
        p = subprocess.run([scontrol, "show", "node", "-o", ",".join(nodes)], capture_output=True, text=True,
                           timeout=timeout_s, stdin=subprocess.DEVNULL)
        info = parse_node_lines(p.stdout) if p.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired):
        info = {}
    return {n: (info.get(n) or {}).get("NodeAddr") or n for n in nodes}


class Ring:
    """This rank's two links: `nxt` (it connected to its successor) and `prev` (its predecessor connected to it)."""

    def __init__(self, rank: int, world: int, nxt: socket.socket, prev: socket.socket) -> None:
        self.rank, self.world, self.nxt, self.prev = rank, world, nxt, prev
        for s in (nxt, prev):
            s.setblocking(False)

    @classmethod
    def form(cls, rank: int, world: int, addr_of: list[str], port_of: list[int],
             connect_s: float = CONNECT_S) -> "Ring":
        """Listen on this rank's port, dial the successor until it listens, take the predecessor's call."""
        deadline = time.monotonic() + connect_s
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lsock.bind(("0.0.0.0", port_of[rank]))
            lsock.listen(4)
            succ = (rank + 1) % world
            nxt = _dial(addr_of[succ], port_of[succ], rank, deadline)
            lsock.settimeout(max(0.1, deadline - time.monotonic()))
            while True:
                try:
                    prev, _ = lsock.accept()
                except OSError as e:
                    nxt.close()
                    raise RingError(f"rank {rank}: no call from rank {(rank - 1) % world}: {e}") from None
                prev.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    who = struct.unpack("!I", _recv_exact(prev, 4))[0]
                except (OSError, RingError):
                    prev.close()
                    continue
                if who == (rank - 1) % world:
                    break
                prev.close()  # not this step's predecessor
        finally:
            lsock.close()
        for s in (nxt, prev):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, world, nxt, prev)

    def all_reduce(self, nbytes: int) -> None:
        """One ring all_reduce of `nbytes`: reduce-scatter then all-gather, 2 (W - 1) exchanges of nbytes / W."""
        chunk = max(1, nbytes // self.world)
        out = bytes(chunk)
        buf = bytearray(chunk)
        for _ in range(2 * (self.world - 1)):
            self._exchange(out, buf)

    def _exchange(self, out: bytes, buf: bytearray) -> None:
        view, sent, got = memoryview(buf), 0, 0
        deadline = time.monotonic() + IO_S
        with selectors.DefaultSelector() as sel:
            sel.register(self.nxt, selectors.EVENT_WRITE, "w")
            sel.register(self.prev, selectors.EVENT_READ, "r")
            while sent < len(out) or got < len(buf):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RingError(f"rank {self.rank}: no progress for {IO_S:g}s")
                for key, _ in sel.select(left):
                    if key.data == "w":
                        sent += self.nxt.send(out[sent:sent + (1 << 20)])
                        if sent >= len(out):
                            sel.unregister(self.nxt)
                    else:
                        n = self.prev.recv_into(view[got:])
                        if n == 0:
                            raise RingError(f"rank {self.rank}: rank {(self.rank - 1) % self.world} closed its link")
                        got += n
                        if got >= len(buf):
                            sel.unregister(self.prev)

    def close(self) -> None:
        for s in (self.nxt, self.prev):
            try:
                s.close()
            except OSError:
                pass


def _dial(host: str, port: int, rank: int, deadline: float) -> socket.socket:
    last: Optional[OSError] = None
    while time.monotonic() < deadline:
        try:
            s = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            s.sendall(struct.pack("!I", rank))
            return s
        except OSError as e:  # not listening yet
            last = e
            time.sleep(0.05)
    raise RingError(f"rank {rank}: cannot reach {host}:{port}: {last}")


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = s.recv(n - len(data))
        if not part:
            raise RingError("link closed")
        data += part
    return data


def time_sizes(ring: Ring, sizes: list[int], warmup: int, iters: int) -> list[tuple[float, float]]:
    """(out-of-place, in-place) microseconds per all_reduce for each size, as nccl-tests times them: `warmup`
    untimed iterations, then the mean of `iters` timed ones (each of the two placements timed on its own)."""
    out = []
    for size in sizes:
        for _ in range(max(0, warmup)):
            ring.all_reduce(size)
        pair = []
        for _place in ("oop", "ip"):
            t0 = time.perf_counter()
            for _ in range(max(1, iters)):
                ring.all_reduce(size)
            pair.append((time.perf_counter() - t0) * 1e6 / max(1, iters))
        out.append((pair[0], pair[1]))
    return out
