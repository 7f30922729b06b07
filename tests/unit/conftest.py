"""Fixtures shared by the unit tests: the real local servers notifications are delivered to (notify_servers.py), and
whole pipeline runs that do not wait for a health-check round that cannot happen here."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from notify_servers import SmtpServer, WebhookServer

from gpuguard.pipeline import run as pipeline_run


@pytest.fixture
def hook() -> Iterator[WebhookServer]:
    """A real local HTTP server that records every webhook POST (generic JSON and Slack-style)."""
    server = WebhookServer()
    yield server
    server.close()


@pytest.fixture
def smtp() -> Iterator[SmtpServer]:
    """A real local SMTP server that records every message."""
    server = SmtpServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _no_storm_settle(monkeypatch: Any) -> None:
    """Before a drain the drain-storm guard may check, a node marks its intent in Slurm and waits up to 2 s
    (STORM_SETTLE_S) for the other nodes of its health-check round to mark theirs, then takes slurmctld's census. The
    unit tests run one node at a time (the in-memory Slurm has no census at all), so the wait only costs time. The
    guard itself is tested in test_storm.py and on a real cluster (tests/integration/test_own_faults.py)."""
    monkeypatch.setattr(pipeline_run, "STORM_SETTLE_S", 0.0)
