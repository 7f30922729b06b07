"""What the hook client and the node agent say to each other over the agent's Unix socket.

The agent's child for a connection says `hello <pid>`; only then does the client send its one request (with its
stdin/stdout/stderr attached, SCM_RIGHTS):

    b"gpuguard-hook/2 <length>\\n" + <length> bytes of NUL-terminated fields:
    kind, cwd, umask, nice, oom_score_adj, rlimits, started, executable, package, runtime, streams, fds, len(args),
    args..., len(env), K=V...

and the child answers with lines: `ready <pid>` (it holds the request and waits),
after the client's `go`: `code <n> <deadline_s>` whenever the exit code the hook would end with changes,
`verdict <n>` once that code is the run's verdict (a client that does not know the verb skips it), and
`exit <n>` once it is done; or `refused <why>` at any point before `go`. Every field is data: the environment is
the job's (hostile), it is only ever put back into the child's environment, where the hook validates it as it
would in its own process. The client imports this before every job, so it imports nothing but os, sys and the
socket module's C core (_socket: the socket module would pull in selectors and enum).
"""

from __future__ import annotations

import os
import sys

import _socket


MAGIC = b"gpuguard-hook/2"
MAX_REQUEST_BYTES = 1 << 20  # a prolog's environment is a few KiB; anything near this is refused, not truncated
MAX_LINE_BYTES = 256
HOOK_KINDS = ("prolog", "epilog", "healthcheck")
SOCKET_NAME = "agent.sock"
_AF_UNIX_PATH_MAX = 100  # sun_path is 108 bytes; longer paths go through /proc/self/fd (tests' temp dirs)


class WireError(ValueError):
    pass


class HookRequest:
    """One hook run as the hook process would have run it."""

    __slots__ = ("kind", "args", "env", "cwd", "umask", "nice", "oom_score_adj", "rlimits", "started", "executable",
                 "package", "runtime", "streams", "fds")

    def __init__(self, kind: str, args: list[str], env: dict[bytes, bytes], cwd: str, umask: int, nice: int,
                 oom_score_adj: int | None, rlimits: dict[int, tuple[int, int]], started: float, executable: str,
                 package: str, runtime: str, fds: str, streams: str = "") -> None:
        self.kind, self.args, self.env, self.cwd = kind, args, env, cwd
        self.umask, self.nice, self.oom_score_adj, self.started = umask, nice, oom_score_adj, started
        self.rlimits = rlimits  # resource number -> (soft, hard); the NCCL tier needs slurmd's RLIMIT_MEMLOCK
        # which Python and which gpuguard sent it: the agent runs only requests its own code would run the same way
        self.executable, self.package, self.runtime, self.fds = executable, package, runtime, fds
        # how the hook process encodes its stdout and stderr (stream_settings): the child takes them over
        self.streams = streams


def runtime_signature() -> str:
    """What about this interpreter changes how a hook behaves besides its code: version, file name encoding, -I.
    Not how stdout and stderr encode text: that follows the locale, which differs between slurmd's bare hook
    environment (C: surrogateescape) and a service with LANG from /etc/locale.conf (en_US.UTF-8: strict), and would
    have made the agent refuse every hook on such a node; the child takes the hook's settings over instead."""
    return f"{sys.version}|{sys.getfilesystemencoding()}|isolated={sys.flags.isolated}"


def stream_settings() -> str:
    """`encoding:errors|encoding:errors` of this process's stdout and stderr."""
    return "|".join(f"{getattr(s, 'encoding', None) or ''}:{getattr(s, 'errors', None) or ''}"
                    for s in (sys.stdout, sys.stderr))


def package_dir() -> str:
    """The directory of the gpuguard this process runs (resolved when it was imported: gpuguard/__init__.py)."""
    pkg = sys.modules["gpuguard"]
    paths = list(getattr(pkg, "__path__", []) or [])
    return paths[0] if paths else os.path.dirname(os.path.abspath(pkg.__file__ or ""))


def socket_path(directory: str) -> str:
    return os.path.join(directory, SOCKET_NAME)


def encode_request(req: HookRequest) -> bytes:
    fields = [os.fsencode(f) for f in (req.kind, req.cwd, str(req.umask), str(req.nice),
                                       "" if req.oom_score_adj is None else str(req.oom_score_adj),
                                       ",".join(f"{n}:{s}:{h}" for n, (s, h) in sorted(req.rlimits.items())),
                                       repr(req.started),
                                       req.executable, req.package, req.runtime, req.streams, req.fds,
                                       str(len(req.args)),
                                       *req.args,
                                       str(len(req.env)))]
    fields += [k + b"=" + v for k, v in req.env.items()]
    if any(b"\0" in f for f in fields):
        raise WireError("a field contains NUL")
    body = b"\0".join(fields) + b"\0"
    if len(body) > MAX_REQUEST_BYTES:
        raise WireError(f"request of {len(body)} bytes is over {MAX_REQUEST_BYTES}")
    return MAGIC + b" " + str(len(body)).encode() + b"\n" + body


def body_length(header: bytes) -> int:
    """The body's length from the request's first line (without its newline)."""
    magic, _, length = header.partition(b" ")
    if magic != MAGIC or not length.isdigit() or len(length) > 8:
        raise WireError("not a gpuguard hook request")
    n = int(length)
    if n > MAX_REQUEST_BYTES:
        raise WireError(f"request of {n} bytes is over {MAX_REQUEST_BYTES}")
    return n


def decode_request(body: bytes) -> HookRequest:
    """Raises WireError on anything malformed."""
    if not body.endswith(b"\0"):
        raise WireError("truncated request")
    fields = body[:-1].split(b"\0")
    try:
        head, rest = fields[:13], fields[13:]
        kind, cwd, umask, nice, oom, limits, started, executable, package, runtime, streams, fds, nargs = \
            (os.fsdecode(f) for f in head)
        args = [os.fsdecode(a) for a in rest[:int(nargs)]]
        rest = rest[int(nargs):]
        nenv = int(rest[0])
        pairs = rest[1:]
        if len(head) != 13 or len(args) != int(nargs) or len(pairs) != nenv:
            raise WireError("field counts do not add up")
        env = dict(_split_env(p) for p in pairs)
        req = HookRequest(kind, args, env, cwd, int(umask), int(nice), int(oom) if oom else None,
                          _rlimits(limits), float(started), executable, package, runtime, fds, streams)
    except (ValueError, IndexError) as e:
        raise WireError(f"malformed request: {e}") from None
    if req.kind not in HOOK_KINDS:
        raise WireError(f"unknown hook kind {req.kind!r}")
    if not os.path.isabs(req.cwd) or not 0 <= req.umask <= 0o777 or not -20 <= req.nice <= 19 \
            or not set(req.fds) <= set("012") or len(req.fds) != len(set(req.fds)):
        raise WireError("bad process settings")
    return req


def _rlimits(text: str) -> dict[int, tuple[int, int]]:
    out = {}
    for item in filter(None, text.split(",")):
        n, soft, hard = (int(x) for x in item.split(":"))
        out[n] = (soft, hard)
    return out


def _split_env(pair: bytes) -> tuple[bytes, bytes]:
    key, eq, value = pair.partition(b"=")
    if not key or not eq:
        raise WireError("environment entry without a name")
    return key, value


# --------------------------------------------------------------------------- the socket


def address(path: str) -> tuple[str, int | None]:
    """(address to bind/connect, directory fd to close afterwards): paths too long for sun_path go through the
    directory's /proc/self/fd entry."""
    if len(os.fsencode(path)) < _AF_UNIX_PATH_MAX:
        return path, None
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def peer_uid(sock: _socket.socket) -> int:
    """The uid of the process at the other end (SO_PEERCRED: pid, uid, gid as native ints)."""
    creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[4:8], sys.byteorder)


def peer_pid(sock: _socket.socket) -> int:
    """The pid of the process at the other end: for a client, the agent that listens (SO_PEERCRED)."""
    creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[0:4], sys.byteorder)


class LineReader:
    """Lines from a socket with a timeout per read; `None` at EOF."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def line(self, timeout_s: float) -> bytes | None:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE_BYTES:
                raise WireError("line too long")
            self.sock.settimeout(max(0.001, timeout_s))
            data = self.sock.recv(4096)
            if not data:
                return None
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line


def send_with_fds(sock: _socket.socket, data: bytes, fds: list[int]) -> None:
    """`data` with `fds` attached (SCM_RIGHTS), then the rest of `data` if the first send was short."""
    rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)
    sent = sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)] if fds else [])
    if sent < len(data):
        sock.sendall(data[sent:])
