"""Every test gets its own gpuguard state and runtime directories (the last good config, the verdict journals):
runs never share them through /var/lib/gpuguard or /run/gpuguard, in-process or in a subprocess they start."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _private_gpuguard_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    base = tmp_path_factory.mktemp("gg-dirs")
    monkeypatch.setenv("GPUGUARD_STATE_DIR", str(base / "state"))
    monkeypatch.setenv("GPUGUARD_RUNTIME_DIR", str(base / "run"))


# The node-wide directories a test must never write (a journal left in /run/gpuguard by one test is evidence the
# next test's node "already handled": CI once saw a drain recorded for the wrong check that way). Checked once for
# the whole session, on the controller when pytest-xdist runs workers.
_SHARED_DIRS = ("/run/gpuguard", "/var/lib/gpuguard")


def _shared_snapshot() -> dict[str, int]:
    out: dict[str, int] = {}
    for d in _SHARED_DIRS:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            try:
                out[os.path.join(d, name)] = os.stat(os.path.join(d, name)).st_mtime_ns
            except OSError:
                pass
    return out


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SHARED_KEY] = _shared_snapshot()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return
    before = session.config.stash.get(_SHARED_KEY, None)
    if before is None:
        return
    after = _shared_snapshot()
    touched = sorted(p for p, m in after.items() if before.get(p) != m)
    if touched:
        sys.stderr.write("\nERROR: tests wrote gpuguard's node-wide directories (a test lost its private "
                         f"GPUGUARD_STATE_DIR/GPUGUARD_RUNTIME_DIR): {', '.join(touched)}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SHARED_KEY = pytest.StashKey[dict]()
