"""Running external tools from root hooks: argv lists only (never a shell), stdin closed, a hard timeout, and
the tool in its own session so a hung tool and everything it started are killed together (a wrapper script's
children would otherwise keep the pipes open and hang the caller)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Optional

from gpuguard.util.record import Record, record

# slurmd runs hooks without PATH
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@record
class ToolRun(Record):
    rc: Optional[int]
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    error: Optional[str] = None  # could not start, or timed out
    missing: bool = False  # the binary does not exist (a tool not installed: incomplete, never a failure)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out and self.error is None

    def text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    def err_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    def last_stderr_line(self, limit: int = 300) -> str:
        lines = self.stderr.decode("utf-8", errors="replace").strip().splitlines()
        return lines[-1][:limit] if lines else ""


def which(name: str) -> Optional[str]:
    """`shutil.which(name)` in PATH, else DEFAULT_PATH (slurmd gives hooks none), without importing shutil on the
    hooks' path (it imports bz2 and lzma, which load their libraries: milliseconds of every hook's start-up)."""
    if os.sep in name:
        return name if _executable(name) else None
    for directory in (os.environ.get("PATH") or DEFAULT_PATH).split(os.pathsep):
        candidate = os.path.join(directory or os.curdir, name)
        if _executable(candidate):
            return candidate
    return None


def _executable(path: str) -> bool:
    return os.access(path, os.F_OK | os.X_OK) and not os.path.isdir(path)


def run_tool(argv: list[str], timeout_s: float, env: Optional[Mapping[str, str]] = None) -> ToolRun:
    """Run `argv` for at most `timeout_s`. Never raises; a missing binary is `error="... not found"`."""
    exe = argv[0] if os.sep in argv[0] else (which(argv[0]) or argv[0])
    try:
        proc = subprocess.Popen([exe, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                                env=dict(env) if env is not None else None)
    except FileNotFoundError:
        return ToolRun(None, b"", b"", error=f"{os.path.basename(argv[0]) or argv[0]} not found", missing=True)
    except (OSError, ValueError) as e:
        return ToolRun(None, b"", b"", error=f"cannot run {argv[0]}: {getattr(e, 'strerror', None) or e}")
    try:
        out, err = proc.communicate(timeout=max(0.001, timeout_s))
        return ToolRun(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        try:
            out, err = proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:
            # something outside the group still holds the pipes (or the tool is stuck in D state): give up on
            # its output rather than hang the caller
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            out, err = b"", b""
        return ToolRun(proc.returncode, out or b"", err or b"", timed_out=True,
                       error=f"{os.path.basename(argv[0])} timed out after {timeout_s:g}s")
