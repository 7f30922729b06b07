"""The node agent: `python -I -m gpuguard.agent.server [--state-dir DIR] [--exit-with-parent]`, started and kept
alive by `gpuguard watch --agent` (gpuguard.agent.supervise).

It imports the whole hook path once (the pipeline, pynvml, SQLite, the checks and the Xid catalog), then, single-
threaded so that forking is safe, accepts hook requests on `<state dir>/agent.sock` (0600, root only, checked again
with SO_PEERCRED) and forks one child per request. The parent never reads a request, never touches NVML or the
store, and so cannot be wedged by a client or a hung GPU. The child (`serve_request`) takes the hook's environment,
working directory, umask, priority, OOM score and standard streams, and runs gpuguard.cli.hooks.run_hook exactly as
the hook process would have; its exit code goes back to the client, which exits with it.

It refuses to start where a hook would not run as slurmd runs it (gpuguard.agent.confinement), when another agent
holds `<state dir>/agent.lock`, or when the state directory is writable by others. As soon as the code on disk is not
the code it runs (gpuguard.agent.stamp: an upgrade, a file edited) it refuses the request at hand (the hook runs in
its own process), logs what changed and re-executes itself with the new code: a request is never run by old code.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import os
import select
import signal
import socket
import stat
import sys
import threading
from typing import NoReturn, Optional

import pynvml  # noqa: F401 - imported once here rather than in every hook (gpuguard.probes.nvml imports it lazily)

from gpuguard.agent import EXIT_BUSY, EXIT_CODE_CHANGED, EXIT_CONFINED, EXIT_STOPPED, EXIT_UNSAFE, wire
from gpuguard.agent.adopt import adopt, mismatch
from gpuguard.agent.confinement import confinement_issues
from gpuguard.agent.stamp import CodeWatch
from gpuguard.checks import registry
from gpuguard.cli import hooks
from gpuguard.notify.apprise_target import preload as preload_apprise
from gpuguard.util import nodedirs
from gpuguard.xid.catalog import load_catalog

REQUEST_TIMEOUT_S = 5.0  # the client sends its request right after `hello` (seconds under a burst on a loaded node)
GO_TIMEOUT_S = 5.0  # and says `go` right after `ready`; a client that went its own way never starts a run
POLL_S = 1.0


def _log(msg: str) -> None:
    print(f"gpuguard agent[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


# What hooks import only on some paths (the health check's EFA counters and pruning, a drain's notification, the
# optional NCCL/DCGM tier): imported here once, so that no child pays for it. One that cannot be imported (an
# optional dependency missing) is left to the child, which handles it as the hook process would.
WARM_MODULES = ("gpuguard.nccl.tier", "gpuguard.nccl.probe", "gpuguard.probes.dcgm", "gpuguard.probes.efa_counters",
                "gpuguard.fleet.ship", "gpuguard.notify", "gpuguard.pipeline.stormguard", "gpuguard.metrics.node",
                # the kernel-log readers (gpuguard.kernellog.sources imports the one a spec names)
                "gpuguard.kernellog.kmsg", "gpuguard.kernellog.journal", "gpuguard.kernellog.dmesg",
                "gpuguard.kernellog.file",
                # what gpuguard.pipeline.run imports only for an epilog or a health check
                "gpuguard.pipeline.cleanup", "gpuguard.pipeline.undrain", "gpuguard.store.retention")


def warm() -> None:
    """What every hook would otherwise build itself; pure data, safe to share across fork."""
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - see WARM_MODULES
            pass
    registry()
    load_catalog()
    try:
        preload_apprise()  # a drain page from a child costs only its HTTP request
    except Exception:  # noqa: BLE001 - see WARM_MODULES
        pass


# --------------------------------------------------------------------------- the listening socket


def check_directory(directory: str) -> Optional[str]:
    """Why `directory` cannot hold the socket, or None: another user able to write it could replace the socket."""
    try:
        st = os.stat(directory)
    except OSError as e:
        return f"{directory}: {e.strerror}"
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return f"{directory} is writable by others or not owned by uid {os.geteuid()}"
    return None


def listen(path: str) -> socket.socket:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{path} exists and is not a socket")
        os.unlink(path)  # a previous agent's (we hold the lock)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    addr, dirfd = wire.address(path)
    old = os.umask(0o177)  # created 0600: only root may connect
    try:
        sock.bind(addr)
    finally:
        os.umask(old)
        if dirfd is not None:
            os.close(dirfd)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


# --------------------------------------------------------------------------- the parent


class Agent:
    def __init__(self, directory: str, exit_with_parent: bool = False) -> None:
        self.directory = directory
        self.path = wire.socket_path(directory)
        self.parent = os.getppid() if exit_with_parent else None
        self.code: Optional[CodeWatch] = None
        self.lock_fd: Optional[int] = None
        self.listener: Optional[socket.socket] = None
        self.served = 0

    def start(self) -> Optional[int]:
        """None when ready to serve, else the exit code."""
        issues = confinement_issues()
        if issues:
            _log("not starting: hooks would not run here as slurmd runs them: " + "; ".join(issues))
            return EXIT_CONFINED
        os.makedirs(self.directory, mode=0o755, exist_ok=True)
        unsafe = check_directory(self.directory)
        if unsafe:
            _log(f"not starting: {unsafe}")
            return EXIT_UNSAFE
        self.lock_fd = os.open(os.path.join(self.directory, "agent.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                               0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"not starting: another agent serves {self.directory}")
            return EXIT_BUSY
        warm()
        if threading.active_count() != 1:
            _log("not starting: a thread is running, forking would not be safe")
            return EXIT_UNSAFE
        self.code = CodeWatch()
        self.listener = listen(self.path)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_STOPPED))  # serve()'s finally removes the socket
        _log(f"serving hooks on {self.path}")
        return None

    def serve(self) -> int:
        assert self.listener is not None
        try:
            while True:
                ready, _, _ = select.select([self.listener], [], [], POLL_S)
                self.reap()
                if self.parent is not None and os.getppid() != self.parent:
                    _log("the watch daemon is gone: stopping")
                    return EXIT_STOPPED
                if ready and not self.accept_pending():
                    return EXIT_CODE_CHANGED
                if not ready and self.code_changed():  # idle: an upgrade is taken up without waiting for a hook
                    return EXIT_CODE_CHANGED
        finally:
            self.close()

    def accept_pending(self) -> bool:
        """Hand every connection already queued to a child of its own, the code on disk checked once for all of
        them (a burst of hooks queues many: each one's wait for its child is the time the agent takes for the
        ones before it). False: the code on disk changed, stop."""
        assert self.listener is not None
        changed = self.code_changed()
        while True:
            if not self.accept(changed):
                return False
            ready, _, _ = select.select([self.listener], [], [], 0)
            if not ready:
                return True

    def accept(self, code_changed: bool) -> bool:
        """Hand one connection to a child, which the agent announces (`hello PID`: the hook may send its request
        and streams, the child exists). False: the code on disk changed, stop."""
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return True
        with conn:
            if wire.peer_uid(conn) != os.geteuid():
                return True
            if code_changed:
                _send(conn, b"refused code changed\n")  # the hook runs in its own process, with the new code
                return False
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self._become_child(conn)
            self.served += 1
            _send(conn, f"hello {pid}\n".encode())  # before the child could say anything: it waits for the request
        return True

    def code_changed(self) -> bool:
        assert self.code is not None
        why = self.code.changed()
        if why is not None:
            _log(f"gpuguard changed on disk since the agent started ({why}): restarting with the code now installed; "
                 "until it is up, the hooks run in their own processes")
        return why is not None

    def _become_child(self, conn: socket.socket) -> NoReturn:
        code = 70
        try:
            assert self.listener is not None
            self.listener.close()
            if self.lock_fd is not None:
                os.close(self.lock_fd)  # the lock is the agent's, not its children's
            code = serve_request(conn)
        except BaseException:  # noqa: BLE001 - never back into the parent's loop
            pass
        os._exit(code)

    def reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            try:
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    os.unlink(self.path)
            except OSError:
                pass


# --------------------------------------------------------------------------- the child: one hook run


def _send(conn: socket.socket, data: bytes) -> bool:
    try:
        conn.sendall(data)
        return True
    except OSError:
        return False


def read_request(conn: socket.socket) -> tuple[wire.HookRequest, list[int]]:
    conn.settimeout(REQUEST_TIMEOUT_S)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    try:
        while b"\n" not in data[:64]:
            if len(data) >= 64 or not (more := conn.recv(1 << 16)):
                raise wire.WireError("no request header")
            data += more
        header, _, body = data.partition(b"\n")
        need = wire.body_length(header)
        while len(body) < need:
            more = conn.recv(min(1 << 16, need - len(body)))
            if not more:
                raise wire.WireError("truncated request")
            body += more
        return wire.decode_request(body[:need]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def serve_request(conn: socket.socket) -> int:
    """One hook run in this child of the agent (which said `hello PID` for it)."""
    try:
        req, fds = read_request(conn)
    except (OSError, wire.WireError) as e:
        _send(conn, f"refused {str(e)[:200]}\n".encode(errors="replace"))
        return 2
    why = mismatch(req)
    if why is None:
        try:
            adopt(req, fds)
        except (OSError, ValueError, LookupError) as e:
            why = f"cannot take over the hook's process settings: {e}"
    if why is not None:
        # the hook runs in its own process instead, at full cost: said where the admin looks for the agent
        _log(f"refused a {req.kind}: {why} (it runs in its own process)")
        _send(conn, f"refused {why}\n".encode(errors="replace"))
        return 2
    if not _send(conn, f"ready {os.getpid()}\n".encode()):
        return 2
    if wire.LineReader(conn).line(GO_TIMEOUT_S) != b"go":
        return 2  # the client ran the hook itself (it timed out on us) or went away
    return run_for_client(conn, req)


def run_for_client(conn: socket.socket, req: wire.HookRequest) -> NoReturn:
    lock = threading.Lock()

    def send(line: str) -> None:
        with lock:
            _send(conn, line.encode())

    def exit_process(code: int) -> NoReturn:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        send(f"exit {code}\n")
        os._exit(code)

    def client_gone() -> None:  # slurmd killed the hook (its timeout) or the client gave up: so does the run
        conn.settimeout(None)
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        os._exit(3)

    threading.Thread(target=client_gone, name="agent-client", daemon=True).start()
    try:
        kind, config, simulate = hooks.parse_hook_args(req.args)
    except hooks.HookUsageError as e:
        print(f"{hooks.USAGE}\ngpuguard: error: {e}", file=sys.stderr)
        exit_process(2)
    def report(code: int, ends_s: float, final: bool) -> None:
        send(f"code {code} {ends_s:g}\n" + (f"verdict {code}\n" if final else ""))

    code = hooks.run_hook(kind, config, simulate, started=req.started, report=report, exit_process=exit_process,
                          via="agent")
    exit_process(code)


# --------------------------------------------------------------------------- entry


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuguard.agent.server", description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", help=f"where agent.sock lives (default ${nodedirs.ENV_STATE_DIR} or "
                                        f"{nodedirs.DEFAULT_STATE_DIR}: the hooks look there)")
    ap.add_argument("--exit-with-parent", action="store_true", help="stop when the process that started it ends")
    args = ap.parse_args(argv)
    agent = Agent(args.state_dir or nodedirs.state_dir(), exit_with_parent=args.exit_with_parent)
    code = agent.start()
    if code is not None:
        return code
    code = agent.serve()
    if code == EXIT_CODE_CHANGED:
        reexec(sys.argv[1:] if argv is None else argv)
    return code


def reexec(argv: list[str]) -> None:
    """Become a new agent running the code now on disk: the same pid (its supervisor and --exit-with-parent see no
    change), the same interpreter path (a `current` symlink an install renamed leads to the new version). Hooks
    still running in children are the new agent's children; the lock (O_CLOEXEC) and the socket are taken anew.
    Returns only if it cannot (the supervisor then starts a new agent)."""
    cmd = [sys.executable, *(["-I"] if sys.flags.isolated else []), "-m", "gpuguard.agent.server", *argv]
    _log(f"re-executing {' '.join(cmd)}")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(cmd[0], cmd)
    except OSError as e:
        _log(f"cannot re-execute ({e}): exiting for the watch daemon to start a new agent")


if __name__ == "__main__":
    raise SystemExit(main())
