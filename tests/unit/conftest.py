"""Fixtures shared by the unit tests: the real local servers notifications are delivered to."""

from __future__ import annotations

from typing import Iterator

import pytest
from test_notify_servers import SmtpServer, WebhookServer


@pytest.fixture
def hook() -> Iterator[WebhookServer]:
    """A real local HTTP server that records every webhook posted to it."""
    s = WebhookServer()
    yield s
    s.close()


@pytest.fixture
def smtp() -> Iterator[SmtpServer]:
    """A real local SMTP server that records every mail sent to it."""
    s = SmtpServer()
    yield s
    s.close()
