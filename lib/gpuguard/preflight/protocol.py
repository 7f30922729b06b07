"""The pre-flight's wire format between the coordinator (`gpuguard preflight`, on the batch node) and its one
persistent worker per node (gpuguard.preflight.worker --serve): one JSON object per line over TCP. Pure."""

from __future__ import annotations

import json
from typing import Any, Optional

MAX_LINE = 65536
SIZE_FACTOR = 4  # the collective's message sizes grow by this factor from min_bytes to max_bytes


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


class LineReader:
    """Bytes in, whole JSON objects out (a partial line waits for the rest; garbage lines are dropped)."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            msg = decode(line)
            if msg is not None:
                out.append(msg)
        if len(self.buf) > MAX_LINE:
            self.buf = b""
        return out


def decode(line: bytes) -> Optional[dict[str, Any]]:
    try:
        msg = json.loads(line.decode(errors="replace"))
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None
