"""`gpuguard ARGS` as a test runs it: the entry point a shell runs (gpuguard.cli.main.main), in the test's own
process, with its own stdin, stdout, stderr, environment and working directory, and the result as a
CompletedProcess. Shared by both suites.

In-process because the suites run the command line hundreds of times, and a fresh interpreter with its imports
costs ~0.3 s of CPU each on CI's 2 cores. What only a process shows stays a process: the hooks and `check` (they
leave with os._exit so that a hung NVML thread cannot hold them), the daemons (`watch`, `monitor`: signals),
`xid scan` (it reads by file descriptor). Those go to a subprocess here, so a caller need not know which is which;
a test that needs a process for its own reasons (isolation, an exit by a signal) starts one itself."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from typing import Iterator, Mapping, Optional, Union

from gpuguard.util.cliargs import hoist_config

# commands that end with os._exit, read their input by file descriptor or install signal handlers: never in the
# test's process (`xid scan`: file descriptors and forked readers)
NEEDS_A_PROCESS = {"prolog", "epilog", "healthcheck", "check", "watch", "monitor", "xid"}


def gpuguard(*args: str, env: Optional[Mapping[str, str]] = None, input: Union[str, bytes, None] = None,
             cwd: Optional[str] = None, text: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Like subprocess.run([python, -m, gpuguard, *args], capture_output=True, text=text, env=env, input=input,
    cwd=cwd): stdout/stderr are str when `text`, else bytes. `timeout` bounds only a subprocess."""
    argv = [str(a) for a in args]
    _lead, rest = hoist_config(argv)
    if next((a for a in rest if not a.startswith("-")), None) in NEEDS_A_PROCESS:
        return subprocess.run([sys.executable, "-m", "gpuguard", *argv], capture_output=True, text=text, env=env,
                              input=input, cwd=cwd, timeout=timeout)
    from gpuguard.cli.main import main

    stdin = io.BytesIO(input.encode() if isinstance(input, str) else (input or b""))
    out, err = io.BytesIO(), io.BytesIO()
    with _environment(env), _cwd(cwd), _streams(stdin, out, err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors, --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    stdout, stderr = out.getvalue(), err.getvalue()
    if text:
        return subprocess.CompletedProcess(["gpuguard", *argv], code, stdout.decode(errors="replace"),
                                           stderr.decode(errors="replace"))
    return subprocess.CompletedProcess(["gpuguard", *argv], code, stdout, stderr)


@contextlib.contextmanager
def _environment(env: Optional[Mapping[str, str]]) -> Iterator[None]:
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _cwd(cwd: Optional[str]) -> Iterator[None]:
    if cwd is None:
        yield
        return
    saved = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved)


@contextlib.contextmanager
def _streams(stdin: io.BytesIO, out: io.BytesIO, err: io.BytesIO) -> Iterator[None]:
    """Text streams over bytes, as a process has them (with .buffer), UTF-8 as under the C.UTF-8 locale."""
    saved = sys.stdin, sys.stdout, sys.stderr
    mine = (io.TextIOWrapper(stdin, encoding="utf-8", errors="strict"),
            io.TextIOWrapper(out, encoding="utf-8", errors="strict", write_through=True),
            io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", write_through=True))
    sys.stdin, sys.stdout, sys.stderr = mine
    try:
        yield
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
        for stream in mine:
            if not stream.closed:  # (a command may close what it wrapped around stdin)
                stream.flush()
                stream.detach()  # the bytes stay readable
