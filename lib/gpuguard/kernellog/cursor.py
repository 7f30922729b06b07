"""The one kernel-log cursor codec, shared by the hooks (`kernel_log:<node>`, `job:<node>:<id>`) and the watch
daemon (`watch:<node>`): where a source stopped, as the plain JSON object the store keeps.

Stored forms (unchanged from the first releases, so every store a fleet already has stays readable and a node
rolled back to an older gpuguard still understands what a newer one wrote):

    kmsg     {"kind": "kmsg", "boot_id", "seq"}, plus the file position keys below for a *file* of kmsg records
             (a simulated node's kernel log); the oldest stores have no "boot_id"
    journal  {"kind": "journal", "cursor": journald's __CURSOR, "boot_id"}
    dmesg    {"kind": "dmesg", "boot_id", "monotonic_s": last timestamp, "same_ts": records seen with it}
    file     {"kind": "file", "path", "inode", "offset", "head", "head_len"}

A file position resumes at `offset` (just past the last complete line judged) only while `path` names the same
inode, the file is at least `offset` long and its first `head_len` bytes still hash to `head`; otherwise the file
was replaced, truncated or rewritten and is read from its start. `decode` never raises: garbage, a foreign kind or
a field of the wrong type decodes to "no cursor" (or drops that field), which means "read from the start".
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

HEAD_BYTES = 256  # the head hash covers at most this many leading bytes
MAX_JOURNAL_CURSOR = 1024


# NamedTuples, not dataclasses: this module is on every hook's import path, and a dataclass costs ~0.7 ms to define


class FilePosition(NamedTuple):
    path: str
    inode: Optional[int]
    offset: int
    head: str
    head_len: int


class KmsgCursor(NamedTuple):
    boot_id: Optional[str]
    seq: Optional[int]  # newest record judged; None: none yet
    position: Optional[FilePosition] = None  # only for a file of kmsg records


class JournalCursor(NamedTuple):
    cursor: Optional[str]
    boot_id: Optional[str]


class DmesgCursor(NamedTuple):
    boot_id: Optional[str]
    monotonic_s: Optional[float]
    same_ts: int = 0


class FileCursor(NamedTuple):
    position: FilePosition


Cursor = Union[KmsgCursor, JournalCursor, DmesgCursor, FileCursor]


def head_digest(head: bytes) -> str:
    from gpuguard.util.digest import sha256_hex  # only file sources hash; never OpenSSL (gpuguard.util.digest)

    return sha256_hex(head)[:32]


def same_boot(stored: Optional[str], current: Optional[str]) -> bool:
    """A cursor from another boot describes a kernel log that is gone; unknown on either side is trusted."""
    return stored is None or current is None or stored == current


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text(value: Any, limit: int = 128) -> Optional[str]:
    return value if isinstance(value, str) and 0 < len(value) <= limit and "\n" not in value else None


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _position(raw: dict[str, Any]) -> Optional[FilePosition]:
    path, offset, head_len, head = raw.get("path"), _count(raw.get("offset")), _count(raw.get("head_len")), \
        raw.get("head")
    if not isinstance(path, str) or offset is None or head_len is None or head_len > HEAD_BYTES \
            or not isinstance(head, str):
        return None
    return FilePosition(path, _count(raw.get("inode")), offset, head, head_len)


def decode(raw: Any) -> Optional[Cursor]:
    """The cursor a stored object describes, or None when it describes none (start from the beginning)."""
    if not isinstance(raw, dict):
        return None
    kind, boot_id = raw.get("kind"), _text(raw.get("boot_id"))
    if kind == "kmsg":
        return KmsgCursor(boot_id, _count(raw.get("seq")), _position(raw))
    if kind == "journal":
        return JournalCursor(_text(raw.get("cursor"), MAX_JOURNAL_CURSOR), boot_id)
    if kind == "dmesg":
        return DmesgCursor(boot_id, _number(raw.get("monotonic_s")), _count(raw.get("same_ts")) or 0)
    if kind == "file":
        pos = _position(raw)
        return FileCursor(pos) if pos is not None else None
    return None


def _position_fields(pos: FilePosition) -> dict[str, Any]:
    return {"path": pos.path, "inode": pos.inode, "offset": pos.offset, "head": pos.head, "head_len": pos.head_len}


def encode(cursor: Cursor) -> dict[str, Any]:
    """The object to store (JSON-able, in the stored forms above)."""
    if isinstance(cursor, KmsgCursor):
        out: dict[str, Any] = {"kind": "kmsg", "boot_id": cursor.boot_id, "seq": cursor.seq}
        return {**out, **_position_fields(cursor.position)} if cursor.position is not None else out
    if isinstance(cursor, JournalCursor):
        return {"kind": "journal", "cursor": cursor.cursor, "boot_id": cursor.boot_id}
    if isinstance(cursor, DmesgCursor):
        return {"kind": "dmesg", "boot_id": cursor.boot_id, "monotonic_s": cursor.monotonic_s,
                "same_ts": cursor.same_ts}
    return {"kind": "file", **_position_fields(cursor.position)}


def describe(raw: Optional[dict[str, Any]]) -> str:
    """Short human text for a stored cursor (the watch's log line on start)."""
    c = decode(raw)
    if isinstance(c, KmsgCursor):
        return f"kmsg seq={c.seq}" + (f" offset={c.position.offset}" if c.position else "")
    if isinstance(c, JournalCursor):
        return f"journal cursor={c.cursor}"
    if isinstance(c, DmesgCursor):
        return f"dmesg monotonic_s={c.monotonic_s}"
    if isinstance(c, FileCursor):
        return f"file offset={c.position.offset}"
    return "no usable cursor"
