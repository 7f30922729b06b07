"""Shared by both suites: every test gets its own gpuguard state and runtime directories (the last good config, the
verdict journals), so runs never share them through /var/lib/gpuguard or /run/gpuguard, in-process or in a subprocess
they start; no test may write the host's kernel log; and the order in which pytest-xdist hands the tests out (the
longest first)."""

from __future__ import annotations

import builtins
import io
import os
import stat
from typing import Any

import pytest
from hypothesis import settings
from propbudget import examples, profile


@pytest.fixture(autouse=True)
def _private_gpuguard_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    base = tmp_path_factory.mktemp("gg-dirs")
    monkeypatch.setenv("GPUGUARD_STATE_DIR", str(base / "state"))
    monkeypatch.setenv("GPUGUARD_RUNTIME_DIR", str(base / "run"))



# The node-wide directories a test must never write: a journal left in /run/gpuguard by one test is evidence the
# next test's node "already handled" (CI once recorded a drain under the wrong check that way), and a store in
# /var/lib/gpuguard outlives the run. Checked around every test, so the error names the test that wrote there
# (on a machine where something else runs gpuguard at the same time this can name an innocent test).
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


@pytest.fixture(autouse=True)
def _no_writes_to_node_wide_dirs() -> Any:
    before = _shared_snapshot()
    yield
    touched = sorted(p for p, m in _shared_snapshot().items() if before.get(p) != m)
    if touched:
        pytest.fail("this test wrote gpuguard's node-wide directories (a subprocess lost the test's private "
                    f"GPUGUARD_STATE_DIR/GPUGUARD_RUNTIME_DIR, or a config without store.path): {', '.join(touched)}",
                    pytrace=False)


# ----------------------------------------------------------------------------------------- the host's kernel log
# A forged `NVRM: Xid` record written to the real /dev/kmsg is seen by every other health tool on a developer's GPU
# machine (NHC's check_cmd_dmesg, a DCGM or gpud agent) as a fault that never happened. Tests get their kernel-log
# records from sources of their own (a kmsg-format file, a FIFO, a stub dmesg/journalctl); an open of the device for
# writing, by any name, raises in the test process (tests/unit/test_host_kernel_log.py also reads the sources of
# tests/ and devtools/ for writes a subprocess would do).
KMSG = "/dev/kmsg"
KMSG_RDEV = os.makedev(1, 11)  # the kmsg character device, whatever its path


class HostKernelLogWrite(PermissionError):
    pass


def is_host_kernel_log(path: Any) -> bool:
    if isinstance(path, int):
        return False
    try:
        name = os.fsdecode(os.fspath(path))
    except TypeError:
        return False
    if os.path.realpath(name) == KMSG:
        return True
    try:
        st = os.stat(name)
    except (OSError, ValueError):
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == KMSG_RDEV


def _refuse(path: Any) -> None:
    raise HostKernelLogWrite(f"a test opened the host's kernel log {path!r} for writing: use a kernel-log source of "
                             "the test's own (a kmsg-format file, a FIFO, a stub dmesg/journalctl)")


def _guarded_open(real: Any) -> Any:
    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(mode, str) and set(mode) & set("wax+") and is_host_kernel_log(file):
            _refuse(file)
        return real(file, mode, *args, **kwargs)

    open_.__wrapped__ = real  # type: ignore[attr-defined]
    return open_


def _guarded_os_open(real: Any) -> Any:
    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR) and is_host_kernel_log(path):
            _refuse(path)
        return real(path, flags, *args, **kwargs)

    os_open.__wrapped__ = real  # type: ignore[attr-defined]
    return os_open


def pytest_configure(config: pytest.Config) -> None:
    """In every process that runs tests (each xdist worker loads this file too)."""
    # property tests without a count of their own: hypothesis' 100, scaled like the others (tests/propbudget.py)
    settings.register_profile(profile(), max_examples=examples(100), deadline=None)
    settings.load_profile(profile())
    if not hasattr(builtins.open, "__wrapped__"):
        builtins.open = io.open = _guarded_open(builtins.open)  # type: ignore[assignment]  # pathlib uses io.open
    if not hasattr(os.open, "__wrapped__"):
        os.open = _guarded_os_open(os.open)  # type: ignore[assignment]


# ----------------------------------------------------------------------------------------- scheduling
# `make test` runs `pytest -n N --dist loadfile --no-loadscope-reorder`: a worker takes one whole module at a time
# (its module-scoped cluster or PostgreSQL server is built once), in collection order. The modules go out longest
# first: a test marked `slow(seconds)` counts its seconds, any other integration test 3 s, a unit test 0.2 s. So the
# long end-to-end modules start at once, side by side, and the many short unit modules fill in at the end, leaving
# no worker alone with a long one. (xdist's own order puts the modules with the most tests first: the few-test
# torchrun modules came last and one worker ran 930 s while the other ran 600.) A test longer than any module
# around it gets a module of its own.
_DEFAULT_S = {"integration": 3.0, "unit": 0.2}


def _expected_s(item: pytest.Item) -> float:
    mark = item.get_closest_marker("slow")
    if mark is not None:
        return float(mark.args[0])
    return _DEFAULT_S["integration" if "integration" in item.path.parts else "unit"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    ordered = sorted(modules.values(), key=lambda tests: -sum(_expected_s(t) for t in tests))  # stable
    items[:] = [item for tests in ordered for item in tests]
