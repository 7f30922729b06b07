"""One time format for every output: UTC ISO 8601 with a Z ('2026-11-24T20:06:33Z')."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional


def iso_utc(value: Any) -> Optional[str]:
    """Epoch seconds or a datetime (naive = UTC) -> '2026-11-24T20:06:33Z'; None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    else:
        dt = datetime.fromtimestamp(float(value), timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
