"""The coordinator's side of the persistent workers (gpuguard.preflight.worker): one `srun -N1 -w NODE` step per
node for the whole pre-flight (a node whose step cannot start fails alone), each worker dials back, and every round
is sent over those connections. torch is imported once per node, not once per round.

A round ends when every group has answered, or when its allowance is spent, or early: once a group of the same size
has given its result, the others get `LATE_FACTOR` times that long (at least `LATE_MIN_S` more) before they are
stopped. That is what lets a hung node cost seconds instead of the round's whole allowance, and why a stop is
evidence (gpuguard.preflight.judge.round_measurements: a run beside it finished in a fraction of that time)."""

from __future__ import annotations

import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, Optional

from gpuguard.nccl.isolate import Group
from gpuguard.preflight.judge import Step, result_line
from gpuguard.preflight.protocol import LineReader, encode

LATE_FACTOR = 4.0
LATE_MIN_S = 3.0
POLL_S = 0.05


@dataclass
class Worker:
    node: str
    proc: "subprocess.Popen[bytes]"
    out: IO[bytes]
    sock: Optional[socket.socket] = None
    addr: str = ""
    up_s: Optional[float] = None  # seconds from the pool's start to its hello
    import_s: Optional[float] = None
    cuda: bool = False
    reader: LineReader = field(default_factory=LineReader)
    gone: str = ""  # why it cannot take work (its step ended, its connection closed)

    def tail(self) -> str:
        self.out.seek(0)
        lines = [ln for ln in self.out.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:160] if lines else "no output"


@dataclass
class Run:
    group: Group
    gid: str
    started: float
    port: Optional[int] = None
    result: Optional[dict[str, Any]] = None
    error: str = ""
    ended_s: Optional[float] = None


def late_after(group: Group, runs: "list[Run]", quickest: dict[int, float]) -> float:
    """Seconds after which a group still running counts as late: LATE_FACTOR times the quickest run of its size
    (this round's or an earlier one's), at least LATE_MIN_S more; never without such a run (infinity)."""
    times = [r.ended_s for r in runs if r.result is not None and r.ended_s is not None and len(r.group) == len(group)]
    times += [quickest[len(group)]] if len(group) in quickest else []
    if not times:
        return float("inf")
    q = min(times)
    return max(LATE_FACTOR * q, q + LATE_MIN_S)


class WorkerPool:
    def __init__(self, nodes: list[str], here: str, addrs: dict[str, str], *, srun: str = "srun",
                 python: str = sys.executable) -> None:
        self.nodes = nodes
        self.token = secrets.token_hex(8)
        self.listener = socket.create_server(("0.0.0.0", 0), backlog=max(16, len(nodes)))
        self.listener.setblocking(False)
        self.coordinator = f"{addrs.get(here, here)}:{self.listener.getsockname()[1]}"
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.pending: dict[socket.socket, LineReader] = {}
        self.start = time.monotonic()
        self.workers: dict[str, Worker] = {}
        for n in nodes:
            out = tempfile.TemporaryFile()
            argv = [srun, "--overlap", "-N1", "-n1", "-w", n, "--quiet", python, "-m", "gpuguard.preflight.worker",
                    "--coordinator", self.coordinator, "--node", n, "--token", self.token]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.workers[n] = Worker(n, proc, out)
        self.seq = 0
        self.runs: dict[str, Run] = {}

    # ---- start-up
    def up(self) -> list[str]:
        return [n for n, w in self.workers.items() if w.sock is not None and not w.gone]

    def wait_up(self, deadline: float) -> None:
        """Until every worker is up or gone, or `deadline`; once all but some are, the rest get as long again as
        the others took (at least LATE_MIN_S more): a worker that never comes is judged by the caller."""
        while time.monotonic() < deadline:
            if all(w.sock is not None or w.gone for w in self.workers.values()):
                return
            ups = [w.up_s for w in self.workers.values() if w.up_s is not None]
            if ups and self.waited_s() > max(ups) + max(max(ups), LATE_MIN_S):
                return
            self.pump(min(POLL_S * 4, max(0.0, deadline - time.monotonic())))

    def waited_s(self) -> float:
        return time.monotonic() - self.start

    # ---- rounds
    def run_round(self, groups: list[Group], allowance_s: float, job: dict[str, Any],
                  quickest: Optional[dict[int, float]] = None) -> list[Step]:
        """Every group's collective at once; a Step per group (its output one tagged result line, or its error).
        `quickest`: group size -> the quickest earlier run with a result (the early stop's yardstick too)."""
        t0 = time.monotonic()
        runs = []
        for g in groups:
            self.seq += 1
            r = Run(g, f"g{self.seq}", t0)
            self.runs[r.gid] = r
            runs.append(r)
            missing = [n for n in g if n not in self.up()]
            if missing:
                r.error = "; ".join(f"worker on {n} {self.workers[n].gone or 'not up'}" for n in missing)
                r.ended_s = 0.0
                continue
            self._send(g[0], {"op": "run", "gid": r.gid, "rank": 0, "world": len(g),
                              "master": self.workers[g[0]].addr, "port": None, **job})
        while True:
            elapsed = time.monotonic() - t0
            live = [r for r in runs if r.ended_s is None]
            if not live or elapsed >= allowance_s:
                break
            if live and all(elapsed >= late_after(r.group, runs, quickest or {}) for r in live):
                break
            self.pump(POLL_S, runs, job, t0)
        steps = []
        for r in runs:
            if r.ended_s is None:
                for n in r.group:
                    self._send(n, {"op": "abort", "gid": r.gid})
                steps.append(Step(r.group, r.error, None, True, time.monotonic() - t0))
            elif r.result is not None:
                steps.append(Step(r.group, result_line(r.result["sizes"], r.result["busbw_gbps"],
                                                       str(r.result.get("backend")), int(r.result.get("world", 0)),
                                                       r.result.get("starved")),
                                  0, False, r.ended_s))
            else:
                steps.append(Step(r.group, r.error or "no result", 1, False, r.ended_s))
            self.runs.pop(r.gid, None)
        return steps

    # ---- I/O
    def _send(self, node: str, msg: dict[str, Any]) -> None:
        w = self.workers[node]
        if w.sock is None or w.gone:
            return
        try:
            w.sock.sendall(encode(msg))
        except OSError as e:
            w.gone = f"lost ({e})"

    def pump(self, timeout: float, runs: Optional[list[Run]] = None, job: Optional[dict[str, Any]] = None,
             t0: float = 0.0) -> None:
        for key, _ in self.sel.select(timeout=max(0.0, timeout)):
            if key.data is None:
                self._accept()
            elif isinstance(key.data, str):
                self._from_worker(key.data, job or {}, t0)
            else:
                self._hello(key.fileobj)  # type: ignore[arg-type]
        for w in self.workers.values():
            if not w.gone and w.proc.poll() is not None:
                w.gone = f"exited ({w.proc.returncode}): {w.tail()}" if w.sock is None else "exited"
                self._fail_runs(w.node, f"worker on {w.node} {w.gone}", t0)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        conn.setblocking(True)
        conn.settimeout(5.0)
        self.pending[conn] = LineReader()
        self.sel.register(conn, selectors.EVENT_READ, self.pending[conn])

    def _hello(self, conn: socket.socket) -> None:
        reader = self.pending[conn]
        data = self._recv(conn)
        msgs = reader.feed(data) if data else []
        hello = next((m for m in msgs if m.get("op") == "hello"), None)
        if not data or (hello is None and len(reader.buf) > 4096):
            self.sel.unregister(conn)
            del self.pending[conn]
            conn.close()
            return
        if hello is None:
            return
        w = self.workers.get(str(hello.get("node")))
        self.sel.unregister(conn)
        del self.pending[conn]
        if w is None or hello.get("token") != self.token or w.sock is not None:
            conn.close()
            return
        w.sock, w.addr = conn, str(hello.get("addr") or "")
        w.up_s, w.import_s = time.monotonic() - self.start, hello.get("import_s")
        w.cuda = bool(hello.get("cuda"))
        self.sel.register(conn, selectors.EVENT_READ, w.node)

    @staticmethod
    def _recv(conn: socket.socket) -> bytes:
        try:
            return conn.recv(65536)
        except OSError:
            return b""

    def _from_worker(self, node: str, job: dict[str, Any], t0: float) -> None:
        w = self.workers[node]
        data = self._recv(w.sock) if w.sock else b""
        if not data:
            self.sel.unregister(w.sock)
            w.gone = "closed its connection"
            self._fail_runs(node, f"worker on {node} closed its connection", t0)
            return
        for msg in w.reader.feed(data):
            r = self.runs.get(str(msg.get("gid")))
            if r is None or r.ended_s is not None:
                continue
            now = time.monotonic() - t0
            if "port" in msg and r.port is None:
                r.port = int(msg["port"])
                for rank, n in enumerate(r.group[1:], 1):
                    self._send(n, {"op": "run", "gid": r.gid, "rank": rank, "world": len(r.group),
                                   "master": self.workers[r.group[0]].addr, "port": r.port, **job})
            elif isinstance(msg.get("result"), dict):
                r.result, r.ended_s = msg["result"], now
            elif "error" in msg:
                r.error, r.ended_s = f"{node}: {msg['error']}", now
            elif "ended" in msg and node == r.group[0]:
                r.error, r.ended_s = f"{node}: the collective ended (exit {msg['ended']}) without a result", now

    def _fail_runs(self, node: str, why: str, t0: float) -> None:
        for r in self.runs.values():
            if r.ended_s is None and node in r.group:
                r.error, r.ended_s = why, time.monotonic() - t0

    def close(self) -> None:
        """Tell every worker to exit, then stop the steps that are still there (srun's own stop, then SIGKILL)."""
        for n in self.workers:
            self._send(n, {"op": "exit"})
        procs = [w.proc for w in self.workers.values()]
        until = time.monotonic() + 1.0
        while time.monotonic() < until and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        stop([p for p in procs if p.poll() is None])
        for w in self.workers.values():
            if w.sock is not None:
                w.sock.close()
            w.out.close()
        self.listener.close()


def stop(procs: "list[subprocess.Popen[bytes]]") -> None:
    """srun's own stop (SIGINT twice), then SIGKILL: all together, a second apart."""
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        until = time.monotonic() + 1.0
        while time.monotonic() < until and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        procs = [p for p in procs if p.poll() is None]
        if not procs:
            return
    for p in procs:
        p.wait()
