"""Build the fake `libnvidia-ml.so.1` (fakenvml.c) that lets the real pynvml binding run on a scenario.

`build_fake_nvml()` compiles only when the library is missing or older than its source, so callers
(tests, the simulator, `make`) can call it every time. `python -m gpuguard.simulate.build [OUT_DIR]`
prints the library's path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fakenvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror")
COMPILE_TIMEOUT_S = 120


class FakeNvmlBuildError(RuntimeError):
    """The fake NVML library could not be built (no compiler, or the compiler failed)."""


def default_out_dir() -> Path:
    """`<repo>/build/fakenvml` in a source checkout, else the user's cache directory."""
    repo = Path(__file__).resolve().parents[3]
    if (repo / "setup.cfg").is_file() and (repo / "lib" / "gpuguard").is_dir():
        return repo / "build" / "fakenvml"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "gpuguard" / "fakenvml"


def is_up_to_date(library: Path, source: Path = SOURCE) -> bool:
    """True when `library` exists and is not older than `source`."""
    try:
        return library.stat().st_mtime_ns >= source.stat().st_mtime_ns
    except FileNotFoundError:
        return False


def compile_command(cc: str, source: Path, output: Path) -> list[str]:
    return [cc, *CFLAGS, "-o", str(output), str(source), "-lpthread"]


def build_fake_nvml(out_dir: Path | None = None, cc: str = "cc") -> Path:
    """Return the path of an up-to-date `libnvidia-ml.so.1` in `out_dir`, compiling it if needed.

    Raises FakeNvmlBuildError when no compiler is found or compilation fails.
    """
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    library = out / LIBRARY_NAME
    if is_up_to_date(library):
        return library

    compiler = shutil.which(cc)
    if compiler is None:
        raise FakeNvmlBuildError(
            f"C compiler {cc!r} not found: install one (e.g. gcc) or pass cc= to build the fake NVML library"
        )
    out.mkdir(parents=True, exist_ok=True)
    # Remember the source's mtime before compiling: stamping it on the result means an edit made while
    # the compiler ran still leaves the library "older" and triggers the next rebuild.
    source_mtime_ns = SOURCE.stat().st_mtime_ns
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LIBRARY_NAME}.", suffix=".tmp", dir=out)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _run_compiler(compile_command(compiler, SOURCE, tmp))
        os.chmod(tmp, 0o755)  # mkstemp made it 0600; other users (slurmd, a test runner) must load it
        os.utime(tmp, ns=(source_mtime_ns, source_mtime_ns))
        # Atomic: a concurrent loader sees either the old library or the new one, never half a file.
        os.replace(tmp, library)
    finally:
        tmp.unlink(missing_ok=True)
    return library


def _run_compiler(command: list[str]) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise FakeNvmlBuildError(f"compiling the fake NVML library timed out: {' '.join(command)}") from exc
    except OSError as exc:
        raise FakeNvmlBuildError(f"cannot run {command[0]}: {exc}") from exc
    if result.returncode != 0:
        raise FakeNvmlBuildError(
            f"compiling the fake NVML library failed ({' '.join(command)}):\n{result.stderr.strip()}"
        )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print("usage: python -m gpuguard.simulate.build [OUT_DIR]", file=sys.stderr)
        return 2
    try:
        print(build_fake_nvml(Path(args[0]) if args else None))
    except FakeNvmlBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
