"""Shared by both suites: every test gets its own gpuguard state and runtime directories (the last good config, the
verdict journals), so runs never share them through /var/lib/gpuguard or /run/gpuguard, in-process or in a subprocess
they start; and the order in which pytest-xdist hands the tests out (the longest first)."""

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


# ----------------------------------------------------------------------------------------- scheduling
# `make test` runs `pytest -n N --dist loadgroup`: a worker takes one unit at a time, in collection order. A unit is
# a whole module (its module-scoped cluster or PostgreSQL server is built once), except a test marked `slow` that
# shares no module-scoped fixture: it is a unit of its own, so the long end-to-end tests run side by side. Units go
# out longest first (a marked test counts its seconds, any other integration test 3 s, a unit test 0.2 s), so no
# worker is left with a long test once the others are done.
_DEFAULT_S = {"integration": 3.0, "unit": 0.2}


def _expected_s(item: pytest.Item) -> float:
    mark = item.get_closest_marker("slow")
    if mark is not None:
        return float(mark.args[0])
    return _DEFAULT_S["integration" if "integration" in item.path.parts else "unit"]


def _unit(item: pytest.Item) -> str:
    module = item.nodeid.split("::")[0]
    if item.get_closest_marker("slow") is None:
        return module
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        if any(d.scope in ("module", "package") for d in defs):
            return module  # its module's fixture is built once, on one worker
    return item.nodeid


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)
    ordered = sorted(units.items(), key=lambda unit: -sum(_expected_s(i) for i in unit[1]))  # stable: ties keep order
    items[:] = [item for _name, members in ordered for item in members]
    if not getattr(config.option, "loadgroup", False):
        return
    for name, members in ordered:
        for item in members:
            item.add_marker(pytest.mark.xdist_group(name))
