"""`make install`'s package step: every install gets a directory of its own, switched in by one rename.

    python -m gpuguard.cli.versions --root PREFIX/lib/gpuguard --python PYTHON --source DIR [--extras fleet]
    python -m gpuguard.cli.versions --root PREFIX/lib/gpuguard --rollback

Layout under the root:

    versions/<version>-<UTC time>/venv     one venv per install, the package and its dependencies
    versions/<...>/.complete               written last: only a complete, importable version is ever switched to
    current -> versions/<id>               what the hooks run (gpuguard.env: GPUGUARD_PYTHON=<root>/current/venv/...)
    previous -> versions/<id>              the version before it, kept for `--rollback`
    venv                                   an install from before versioned installs (kept once as the previous)

pip replacing the package in place (what `make install` did before) let a prolog that started meanwhile die with
ModuleNotFoundError, which Slurm answers with a "Prolog error" drain gpuguard never lifts. Here the new version is
built beside the one in use (its venv seeded with a copy of the current one when the interpreter is the same, so
pip only replaces what changed), imported once as a hook would, and `current` is then renamed over: a hook starts on
the old version or the new one, never on half of one, and each process keeps to the version it started on
(gpuguard/__init__.py resolves its directory once). Versions other than `current` and `previous` are removed unless
a running process still holds one (every gpuguard process keeps its package directory open for that).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import gpuguard

COMPLETE = ".complete"
PIP_TIMEOUT_S = 900
LEGACY_VENV = "venv"


def version_id(version: str, now: float, taken: set[str]) -> str:
    """`<version>-<UTC time>`, with a suffix when an install in the same second took that name."""
    base = f"{version}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}"
    name, n = base, 1
    while name in taken:
        name, n = f"{base}.{n}", n + 1
    return name


def link_target(root: Path, name: str) -> Optional[Path]:
    """Where the symlink `root/name` leads (an absolute path), or None."""
    link = root / name
    try:
        return (root / os.readlink(link)).resolve()
    except OSError:
        return None


def venv_of(version_dir: Path) -> Path:
    return version_dir if version_dir.name == LEGACY_VENV else version_dir / "venv"


# --------------------------------------------------------------------------- building a version


def interpreter(python: str) -> Optional[str]:
    """What a venv made by `python` runs on: its base interpreter's real path and full version."""
    code = ("import os, sys; print(os.path.realpath(getattr(sys, '_base_executable', sys.executable))); "
            "print(sys.version)")
    try:
        p = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def seed(previous: Path, venv: Path) -> None:
    """A copy of the venv in use, its scripts' and pyvenv.cfg's absolute paths moved to where the copy is."""
    shutil.copytree(previous, venv, symlinks=True)
    old, new = os.fsencode(str(previous)), os.fsencode(str(venv))
    for path in [venv / "pyvenv.cfg", *sorted((venv / "bin").iterdir())]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old in data:
            mode = path.stat().st_mode
            path.write_bytes(data.replace(old, new))
            path.chmod(mode)


def make_venv(python: str, venv: Path, previous: Optional[Path]) -> str:
    """The new version's venv: seeded from `previous` when it runs on the same interpreter as `python` would, else
    a fresh one. Says which."""
    if previous is not None and (previous / "bin" / "python").exists():
        mine = interpreter(python)
        if mine is not None and interpreter(str(previous / "bin" / "python")) == mine:
            try:
                seed(previous, venv)
                return f"seeded from {previous}"
            except OSError as e:
                shutil.rmtree(venv, ignore_errors=True)
                print(f"gpuguard install: could not copy {previous} ({e}): a fresh venv instead", file=sys.stderr)
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=PIP_TIMEOUT_S)
    return "a fresh venv"


def pip_install(venv: Path, source: str, extras: str) -> None:
    """pip builds a source tree's wheel in that tree's build/ directory: two installs from one checkout at once
    (two prefixes, two admins) collided there ("File exists: build/bdist.../gpuguard-0.1.0.dist-info") and one
    failed. Builds from one source directory take turns (flock on a file in it; waiting is bounded by pip's own
    timeout)."""
    spec = f"{source}[{extras}]" if extras else source
    lock_path = os.path.join(source, ".gpuguard-install.lock") if os.path.isdir(source) else None
    lock = open(lock_path, "a") if lock_path else None  # noqa: SIM115 - held for the build
    try:
        if lock is not None:
            deadline = time.monotonic() + PIP_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"another install from {source} held {lock_path} too long") from None
                    time.sleep(0.2)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        spec], check=True, timeout=PIP_TIMEOUT_S)
    finally:
        if lock is not None:
            lock.close()


def check_imports(venv: Path, require: list[str]) -> None:
    """Import the new version as the hooks, the agent and `gpuguard` would, before anything runs it."""
    modules = ["gpuguard.agent.client", "gpuguard.cli.hooks", "gpuguard.agent.server", "gpuguard.cli.main", *require]
    code = f"import {', '.join(modules)}, gpuguard; print(gpuguard.__path__[0])"
    p = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", code], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"the new version does not import: {p.stderr.strip()[-2000:]}")
    if not p.stdout.strip().startswith(str(venv.resolve())):
        raise RuntimeError(f"the new version imports gpuguard from elsewhere: {p.stdout.strip()}")


def build(root: Path, python: str, source: str, extras: str, require: list[str]) -> Path:
    """A complete new version under root/versions; nothing points to it yet."""
    versions = root / "versions"
    versions.mkdir(parents=True, exist_ok=True)
    target = versions / version_id(gpuguard.__version__, time.time(), set(os.listdir(versions)))
    target.mkdir()
    current = link_target(root, "current")
    previous = venv_of(current) if current is not None else (root / LEGACY_VENV if (root / LEGACY_VENV).is_dir()
                                                             else None)
    venv = target / "venv"
    try:
        how = make_venv(python, venv, previous)
        print(f">> gpuguard {gpuguard.__version__}: building {target} ({how})", flush=True)
        pip_install(venv, source, extras)
        check_imports(venv, require)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    (target / COMPLETE).write_text(f"{gpuguard.__version__}\n")
    return target


# --------------------------------------------------------------------------- switching and pruning


def point(root: Path, name: str, target: Path) -> None:
    """root/name -> target (relative), replaced by one rename: a reader sees the old link or the new one."""
    tmp = root / f".{name}.new"
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(os.path.relpath(target, root), tmp)
    os.replace(tmp, root / name)


def switch(root: Path, target: Path) -> Optional[Path]:
    """Make `target` current; the one it replaces (or the pre-versioned venv) becomes previous. Returns that."""
    before = link_target(root, "current")
    if before is None and (root / LEGACY_VENV).is_dir():
        before = root / LEGACY_VENV
    point(root, "current", target)
    if before is not None and before != target.resolve():
        point(root, "previous", before)
    return before


def held_paths(proc: Path = Path("/proc")) -> set[str]:
    """The targets of every open file descriptor of every process (a gpuguard process holds its package
    directory open: gpuguard/__init__.py)."""
    out = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                out.add(os.readlink(proc / pid / "fd" / fd))
            except OSError:
                pass
    return out


def prunable(root: Path, keep: set[Path], held: set[str]) -> tuple[list[Path], list[Path]]:
    """(to remove, kept because a process holds them): every version but `keep`, and the pre-versioned venv."""
    versions = root / "versions"
    candidates = [p for p in sorted(versions.iterdir()) if p.is_dir()] if versions.is_dir() else []
    if (root / LEGACY_VENV).is_dir():
        candidates.append(root / LEGACY_VENV)
    remove, busy = [], []
    for p in candidates:
        real = p.resolve()
        if real in keep:
            continue
        prefix = str(real) + os.sep
        (busy if any(h == str(real) or h.startswith(prefix) for h in held) else remove).append(p)
    return remove, busy


def prune(root: Path) -> None:
    keep = {p for p in (link_target(root, "current"), link_target(root, "previous")) if p is not None}
    remove, busy = prunable(root, keep, held_paths())
    for p in remove:
        shutil.rmtree(p, ignore_errors=True)
        print(f">> removed the old version {p}")
    for p in busy:
        print(f">> kept the old version {p}: a running process still uses it (the next install removes it)")


def rollback(root: Path) -> int:
    current, previous = link_target(root, "current"), link_target(root, "previous")
    if previous is None or not (previous / COMPLETE).is_file():
        print("gpuguard install: no previous version to roll back to (an install from before versioned installs "
              "is not one: install it again)", file=sys.stderr)
        return 1
    point(root, "current", previous)
    if current is not None:
        point(root, "previous", current)
    print(f">> current -> {previous} (was {current})")
    return 0


# --------------------------------------------------------------------------- entry


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuguard.cli.versions", description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="where versions live (make install: $(PREFIX)/lib/gpuguard)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of a fresh venv")
    ap.add_argument("--source", default=".", help="what pip installs (a gpuguard checkout)")
    ap.add_argument("--extras", default="", help="the package's extras to install (make install: fleet)")
    ap.add_argument("--require", action="append", default=[], help="a module the new version must import")
    ap.add_argument("--rollback", action="store_true", help="switch back to the previous version")
    a = ap.parse_args(argv)
    root = Path(a.root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time
        if a.rollback:
            return rollback(root)
        try:
            target = build(root, a.python, a.source, a.extras, a.require)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            print(f"gpuguard install: FAILED, nothing switched ({e}); the version in use stays", file=sys.stderr)
            return 1
        before = switch(root, target)
        print(f">> {root / 'current'} -> {target}" + (f" (previous: {before}, for rollback)" if before else ""))
        prune(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
