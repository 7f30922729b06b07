"""The node agent's child becoming the hook process it serves (gpuguard.agent.server.serve_request): whether the
agent's code would run the request as the hook's own process would (`mismatch`), then taking over the hook's
environment, directory, umask, priority, limits, OOM score and standard streams (`adopt`).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from typing import Optional

from gpuguard.agent import wire


def mismatch(req: wire.HookRequest) -> Optional[str]:
    """Why this agent's code would not run `req` as the client's own process would, or None."""
    mine = wire.package_dir()  # the code this agent loaded, wherever `current` points now
    if os.path.realpath(req.executable) != os.path.realpath(sys.executable):
        return "another Python"
    if os.path.realpath(req.package) != os.path.realpath(mine):
        return "another gpuguard installation"
    if req.runtime != wire.runtime_signature():
        return f"another interpreter setup (the hook's {req.runtime!r}, the agent's {wire.runtime_signature()!r})"
    return None


def adopt(req: wire.HookRequest, fds: list[int]) -> None:
    """Become the hook process: its environment, directory, umask, priority, resource limits, OOM score, standard
    streams."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environb.clear()
    os.environb.update(req.env)
    time.tzset()  # the hook's TZ, for its log lines' timestamps
    os.chdir(req.cwd)
    os.umask(req.umask)
    os.setpriority(os.PRIO_PROCESS, 0, req.nice)
    for limit, (soft, hard) in req.rlimits.items():
        resource.setrlimit(limit, (soft, hard))  # ValueError/OSError: refused, the hook runs in its own process
    if req.oom_score_adj is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(req.oom_score_adj))
        except OSError:
            pass
    for target in (0, 1, 2):
        if str(target) in req.fds:
            fd = fds[req.fds.index(str(target))]
            os.dup2(fd, target)
        else:
            try:
                os.close(target)  # closed in the hook process too
            except OSError:
                pass
    for fd in fds:
        if fd > 2:
            os.close(fd)
    adopt_streams(req.streams)


def adopt_streams(settings: str) -> None:
    """Encode stdout and stderr as the hook process would have (`wire.stream_settings()` there), on the file
    descriptors now in place. LookupError: an encoding or error handler this Python lacks."""
    import codecs
    import io

    parts = (settings.split("|") if settings else []) + ["", ""]
    for fd, name, setting in ((1, "stdout", parts[0]), (2, "stderr", parts[1])):
        stream = getattr(sys, name)
        encoding, _, errors = setting.partition(":")
        if encoding:
            codecs.lookup(encoding)
        if errors:
            codecs.lookup_error(errors)
        if stream is None or (encoding or stream.encoding, errors or stream.errors) == (stream.encoding, stream.errors):
            continue
        stream.flush()
        try:
            tty = os.isatty(fd)
        except OSError:
            tty = False
        # a new wrapper rather than reconfigure(): changing the encoding of a pipe's wrapper fails (Illegal seek)
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
                                            encoding=encoding or stream.encoding, errors=errors or stream.errors,
                                            line_buffering=tty or name == "stderr", write_through=name == "stderr"))
