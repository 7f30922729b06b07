"""One time format for every output: UTC ISO 8601 with a Z ('2026-11-24T20:06:33Z')."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Optional

ISO_UTC = "%Y-%m-%dT%H:%M:%SZ"


def iso_utc(value: Any) -> Optional[str]:
    """Epoch seconds or a datetime (naive = UTC) -> '2026-11-24T20:06:33Z'; None stays None.

    Epoch seconds go through time.gmtime (less than half of datetime's cost: `gpuguard history --limit 0` formats
    one per row), rounded to the microsecond first as datetime rounds them (…59.9999996 is the next second)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return dt.astimezone(timezone.utc).strftime(ISO_UTC)
    return time.strftime(ISO_UTC, time.gmtime(round(float(value), 6)))
