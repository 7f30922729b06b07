"""What code the node agent runs, and whether the code on disk is still that (gpuguard.agent.server checks before
every request: an upgrade must never leave hooks running old code through the agent).

The stamp covers every file of the installed gpuguard package (the modules a hook imports only on some paths and its
data files too: checked before every request), every other file the agent loaded from outside the interpreter's
standard library (pynvml, yaml, apprise, ... wherever they live, a venv's site-packages included: checked at most
every OTHERS_EVERY_S, so that a request pays for a stat of gpuguard's ~270 files rather than ~700), and the
directory `gpuguard` resolves to now (`make install` switches versions by renaming the `current` symlink,
gpuguard.cli.versions). Each file is stamped with its inode, mtime and size: a version switched in, a file replaced
by pip or edited in place all change it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from typing import Callable, Optional

Stamp = tuple[str, list[tuple[str, int, int, int]]]
SITE_DIRS = ("site-packages", "dist-packages")


def _stdlib_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.join(paths[k], "") for k in ("stdlib", "platstdlib"))


def is_stdlib(path: str, stdlib: Optional[tuple[str, ...]] = None) -> bool:
    """Whether `path` is the interpreter's own library. Inside a venv sysconfig's `platstdlib` is the venv's
    lib/pythonX.Y, the parent of its site-packages: a file under a site-packages (or Debian's dist-packages)
    directory is an installed package, never the standard library."""
    if not path.startswith(stdlib if stdlib is not None else _stdlib_prefixes()):
        return False
    return not any(part in SITE_DIRS for part in path.split(os.sep))


def loaded_files() -> list[str]:
    """The files of every module loaded from outside the standard library (gpuguard, pynvml, ...)."""
    stdlib = _stdlib_prefixes()
    out = set()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f:
            f = os.path.abspath(f)
            if not is_stdlib(f, stdlib):
                out.add(f)
    return sorted(out)


def package_dirs() -> list[str]:
    """Where the loaded gpuguard package lives (resolved when it was imported: gpuguard/__init__.py)."""
    pkg = sys.modules.get("gpuguard")
    return list(getattr(pkg, "__path__", []) or [])


def package_files() -> list[str]:
    """Every file of the installed gpuguard package, compiled byte code aside."""
    out = []
    for top in package_dirs():
        for root, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out.extend(os.path.join(root, f) for f in files if not f.endswith((".pyc", ".pyo")))
    return out




def home() -> str:
    """The directory `gpuguard` resolves to now, through the path it was first imported by (a `current` symlink
    renamed by an install points it elsewhere)."""
    pkg = sys.modules.get("gpuguard")
    f = getattr(pkg, "__file__", None)
    return os.path.realpath(os.path.dirname(f)) if f else ""


def code_stamp(files: list[str]) -> Stamp:
    """Where gpuguard resolves to now, and each file's inode, mtime and size (-1s: it is gone)."""
    stamp = []
    for f in files:
        try:
            st = os.stat(f)
            stamp.append((f, st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            stamp.append((f, -1, -1, -1))
    return home(), stamp


def first_change(before: Stamp, now: Stamp) -> Optional[str]:
    """What differs between two stamps of the same files, for the log line; None: nothing."""
    if before[0] != now[0]:
        return f"gpuguard now resolves to {now[0]} (was {before[0]})"
    for a, b in zip(before[1], now[1]):
        if a != b:
            return a[0]
    return None if len(before[1]) == len(now[1]) else "the set of files"


OTHERS_EVERY_S = 1.0


class CodeWatch:
    """The agent's code as it was when it started, and whether the code on disk still is that."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ours = package_files()
        self.others = sorted(set(loaded_files()) - set(self.ours))
        self.ours_stamp, self.others_stamp = code_stamp(self.ours), code_stamp(self.others)
        self.checked = clock()

    def files(self) -> list[str]:
        return self.ours + self.others

    def changed(self) -> Optional[str]:
        """What changed on disk (for the log line), or None: the gpuguard package every time, the other loaded files
        when they were last looked at OTHERS_EVERY_S ago or more."""
        why = first_change(self.ours_stamp, code_stamp(self.ours))
        if why is None and self.clock() - self.checked >= OTHERS_EVERY_S:
            self.checked = self.clock()
            why = first_change(self.others_stamp, code_stamp(self.others))
        return why
