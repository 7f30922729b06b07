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
    """After a drain the pipeline waits up to 2 s (STORM_SETTLE_S) for the other nodes of its health-check round to
    drain, then asks slurmctld's census whether the drains are a storm. The unit tests run one node at a time with no
    slurmctld (the in-memory Slurm has no census; a stub scontrol has no sinfo): the check after the wait can hold
    nothing, so the wait only cost ~2 s per drain. The drain-storm guard itself is tested in test_storm.py and on a
    real cluster (tests/integration/test_own_faults.py)."""
    monkeypatch.setattr(pipeline_run, "STORM_SETTLE_S", 0.0)
