"""Every test gets its own gpuguard state and runtime directories (the last good config, the verdict journals):
runs never share them through /var/lib/gpuguard or /run/gpuguard, in-process or in a subprocess they start."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _private_gpuguard_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    base = tmp_path_factory.mktemp("gg-dirs")
    monkeypatch.setenv("GPUGUARD_STATE_DIR", str(base / "state"))
    monkeypatch.setenv("GPUGUARD_RUNTIME_DIR", str(base / "run"))
