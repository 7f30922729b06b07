"""Every test gets its own gpuguard state and runtime directories (the last good config, the verdict journals):
runs never share them through /var/lib/gpuguard or /run/gpuguard, in-process or in a subprocess they start."""

from __future__ import annotations

import os
from typing import Any

import pytest


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
