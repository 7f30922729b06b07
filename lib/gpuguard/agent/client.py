"""The hook scripts' entry: `python -I -c 'from gpuguard.agent.client import main; raise SystemExit(main())' KIND`
(= `gpuguard KIND [--config F] [--simulate S]`; -c rather than -m: runpy costs milliseconds before every job).

It asks the node agent (gpuguard.agent.server) to run the hook and exits with the agent's answer. It runs the hook in
its own process instead (gpuguard.cli.hooks, as it always did) whenever

- there is no agent socket, nobody listens on it, or the listener is not root (not this user);
- the agent does not fork a child for it, or the child does not take the request, within ACK_TIMEOUT_S each while
  it neither runs nor waits for a CPU (a hung or stopped agent: /proc/PID/schedstat does not move), or within
  PATIENCE_S while it does (a burst of hooks on a loaded node: running the hook here instead would cost the node
  a whole interpreter start-up more, at the worst moment);
- the agent refuses (its code is older than the installed one, another installation, a malformed request, limits
  it cannot give the child);
- the agent's child ends without an answer (killed, crashed: the agent unit restarted, the OOM killer) while there is
  time left, or before its run had a verdict, however late: the run here then shares what is left of the hook's
  deadline, at least gpuguard.cli.hooks.MIN_RUN_S, and a probe that does not answer within its share counts as timed
  out (a hung NVML drains); never an exit 0 for a run that judged nothing.

A child that stops answering is killed once the hook's own deadline (plus its watchdog's second) has passed; the
client exits with its verdict if it had one, else runs the hook here as above. The hook's
standard streams go to the child only once it said hello: a queued connection never holds them. Until it
knows which way it goes, this module imports only os, socket and the wire format (gpuguard.agent.wire).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time

import _socket

from gpuguard.agent.wire import (HOOK_KINDS, HookRequest, LineReader, WireError, address, encode_request, package_dir,
                                 peer_pid, peer_uid, runtime_signature, send_with_fds, socket_path, stream_settings)
from gpuguard.util.nodedirs import state_dir

ACK_TIMEOUT_S = 0.5  # the agent accepts and forks in milliseconds; a hung or stopped one costs a hook this much
# ... but under a burst (a 200-job array starting on 16 nodes at once) it and its children wait for a CPU like
# everything else: while the process we wait for runs or waits for a CPU for at least BUSY_SHARE of each
# ACK_TIMEOUT_S, it is busy, not hung, and we keep waiting, for up to PATIENCE_S from the connection (issue 30:
# with a flat 0.5 s bound 182 of 200 prologs of such a burst fell back, each paying a whole start-up more)
PATIENCE_S = 5.0
BUSY_SHARE = 0.2
FIRST_REPORT_S = 15.0  # the child reports the hook's deadline once the config is loaded (10 s on a hung filesystem)
WATCHDOG_GRACE_S = 2.0  # the hook's watchdog ends it at its deadline + 1 s; after one more second the client stops
MIN_FALLBACK_S = 1.0  # a child that died with its verdict and less time than this left: its verdict stands
SIGKILL = 9
# the limits slurmd's hooks inherit that can change a hook's outcome (the NCCL tier pins memory; fds; core files)
RLIMITS = ("RLIMIT_MEMLOCK", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_DATA",
           "RLIMIT_FSIZE", "RLIMIT_CORE")


NO_AGENT = "no agent"  # nothing listens on the socket: the site runs no agent (or it is stopped): not a fallback


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = list(sys.argv[1:] if argv is None else argv)
    code, why = run_through_agent(args, started)
    if code is not None:
        os._exit(code)
    # cold path: no agent, or it could not run this hook: run it in this process. Importing the hook path creates
    # some hundred thousand objects that live as long as the process; the cyclic garbage collector would walk them
    # again and again while they are created (~9M instructions, ~4% of a prolog's CPU): it is off while they are
    # imported, then they are frozen out of its sight (gc.freeze) and it runs as usual for what the hook allocates.
    gc.disable()
    try:
        from gpuguard.cli import hooks
    finally:
        gc.freeze()
        gc.enable()

    # a fallback says why in the hook's result line (`via=local(...)`): an agent that often falls back is seen
    return hooks.main(args, started=started, via=None if why == NO_AGENT else f"local({why})")


def run_through_agent(args: list[str], started: float, directory: str | None = None,
                      ack_timeout_s: float = ACK_TIMEOUT_S) -> tuple[int | None, str]:
    """(the hook's exit code as the agent ran it, "") or (None, why not): run the hook in this process."""
    if not args or args[0] not in HOOK_KINDS:
        return None, "usage"  # a usage error: the hook's own parser explains it
    path = socket_path(directory or state_dir(os.environ))
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    except OSError as e:
        return None, f"no socket: {e.strerror or e}"
    child = Child()
    why = NO_AGENT
    wait = None
    try:
        sock.settimeout(ack_timeout_s)
        addr, dirfd = address(path)
        try:
            sock.connect(addr)
        finally:
            if dirfd is not None:
                os.close(dirfd)
        if peer_uid(sock) != os.geteuid():
            return None, "agent of another user"  # only an agent running as root may answer for a root hook
        wait = PatientWait(LineReader(sock), ack_timeout_s)
        why = "agent did not start a child"
        # the agent forked a child for us; only now do our stdin/stdout/stderr travel: a connection a stopped
        # agent never accepted must not hold them (whoever reads the hook's output would wait for its end)
        first = wait.line(peer_pid(sock), why)
        if not child.hello(first):
            said = (first or b"").decode("utf-8", "replace").strip()[:120]
            return None, f"agent {said}" if said.startswith("refused") else why
        why = "agent child gave no verdict"
        fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
        send_with_fds(sock, encode_request(_request(args, started, "".join(map(str, fds)))), fds)
        code, refused = _converse(wait, child, started)
        if not child.ended:
            child.kill()  # past the hook's deadline and its watchdog's: it must not act later
        return code, (refused or why) if code is None else ""
    except (OSError, WireError, ValueError) as e:
        if not child.ended:
            child.kill()  # a timeout: alive but not answering, it must not act later
        if isinstance(e, _socket.timeout) and wait is not None and wait.gave_up:
            why = wait.gave_up  # "... within 0.5s (idle)": stopped or hung; "... within 5s (busy)": overloaded
        return None, why if why != NO_AGENT or isinstance(e, (FileNotFoundError, ConnectionRefusedError)) \
            else f"agent unreachable: {type(e).__name__}"
    finally:
        sock.close()


def schedstat_ns(pid: int) -> int | None:
    """Nanoseconds the process `pid` (its main thread) has run or waited for a CPU (/proc/PID/schedstat), None when
    unknown (gone; a kernel without it)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) + int(waited)
    except (OSError, ValueError):
        return None


class PatientWait:
    """The next line from the agent, waited for ACK_TIMEOUT_S at a time: again while the process that owes it (the
    agent, then its child) is busy, until PATIENCE_S after the connection. `gave_up` says why it stopped waiting."""

    def __init__(self, reader: LineReader, ack_timeout_s: float, patience_s: float | None = None) -> None:
        self.reader = reader
        self.ack_timeout_s = ack_timeout_s
        self.until = time.monotonic() + max(PATIENCE_S if patience_s is None else patience_s, ack_timeout_s)
        self.gave_up = ""

    def line(self, pid: int, what: str) -> bytes | None:
        """`what`: the fallback's reason should the wait end without a line ("agent did not start a child")."""
        t0, before = time.monotonic(), schedstat_ns(pid)
        first = t0
        while True:
            try:
                return self.reader.line(self.ack_timeout_s)
            except _socket.timeout:
                now, after = time.monotonic(), schedstat_ns(pid)
                busy = before is not None and after is not None and after - before >= BUSY_SHARE * (now - t0) * 1e9
                if not busy or now >= self.until:
                    self.gave_up = f"{what} within {now - first:.2g}s ({'busy' if busy else 'idle'})"
                    raise
                t0, before = now, after


class Child:
    """The agent's child serving this hook: killed, through a pidfd, whenever the client stops waiting for it."""

    def __init__(self) -> None:
        self.pid = 0
        self.pidfd: int | None = None
        self.ended = True  # nothing to kill until it said hello; again once its socket reached EOF

    def hello(self, line: bytes | None) -> bool:
        if line is None or not line.startswith(b"hello "):
            return False
        self.pid, self.ended = int(line[len(b"hello "):]), False
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):  # Linux < 5.3: the pid (the child cannot be reaped while we hold it)
            self.pidfd = None
        return True

    def kill(self) -> None:
        try:
            if self.pidfd is not None:
                import signal  # cold path: only a hung or stopped child gets here

                signal.pidfd_send_signal(self.pidfd, SIGKILL)
            elif self.pid:
                os.kill(self.pid, SIGKILL)
        except OSError:
            pass
        self.ended = True


def _request(args: list[str], started: float, fds: str) -> HookRequest:
    umask = os.umask(0o022)
    os.umask(umask)
    limits = {getattr(resource, n): resource.getrlimit(getattr(resource, n)) for n in RLIMITS if hasattr(resource, n)}
    return HookRequest(args[0], list(args), dict(os.environb), os.getcwd(), umask, os.getpriority(os.PRIO_PROCESS, 0),
                       _oom_score_adj(), limits, started, sys.executable, package_dir(), runtime_signature(), fds,
                       stream_settings())


def _converse(wait: PatientWait, child: Child, started: float) -> tuple[int | None, str]:
    """(exit code or None, why the agent refused: "" unless it did)."""
    reader = wait.reader
    # _socket.timeout (an OSError): hung before taking the request
    line = wait.line(child.pid, "agent child did not take the hook")
    if line is None or not line.startswith(b"ready "):
        child.ended = True  # gone, or `refused ...` (and ending)
        said = (line or b"").decode("utf-8", "replace").strip()[:120]
        return None, f"agent {said}" if said.startswith("refused") else "agent child ended before taking the hook"
    reader.sock.sendall(b"go\n")
    limit = started + FIRST_REPORT_S
    last: int | None = None
    final = False  # `last` is the run's verdict (the hardware has spoken), not the code a watchdog would exit with
    while True:
        remaining = limit - time.monotonic()
        if remaining <= 0:
            return (last if final else None), ""  # stopped or wedged past its own watchdog: the caller kills it
        try:
            line = reader.line(remaining)
        except _socket.timeout:  # TimeoutError since 3.10
            continue
        if line is None:  # the child ended without an answer
            child.ended = True
            return (last if final and limit - time.monotonic() < MIN_FALLBACK_S else None), ""
        verb, _, rest = line.partition(b" ")
        if verb == b"exit":
            child.ended = True
            return int(rest), ""
        if verb == b"verdict":
            last, final = int(rest), True
        elif verb == b"code":
            code, deadline = rest.split()
            last, limit = int(code), started + float(deadline) + WATCHDOG_GRACE_S


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _oom_score_adj() -> int | None:
    try:
        with open("/proc/self/oom_score_adj", "rb") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
