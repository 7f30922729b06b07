"""The monitor's own log: its stderr, which lands in the job's output, so users see what it saw."""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} gpuguard-monitor: {msg}\n")
    sys.stderr.flush()
