"""Telling real corruption of the store's file from trouble with its environment: they call for opposite things
(move the file aside and start a new one, or keep it untouched and report StoreUnavailable)."""

from __future__ import annotations

import sqlite3

# sqlite3 result codes (sqlite3.h); Python >= 3.11 exposes them on the exception as `sqlite_errorcode`.
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26
# Errors about the environment, never about the file's contents: full, read-only, I/O, permissions, locks, memory.
NOT_CORRUPTION = {3, 5, 6, 7, 8, 10, 13, 14, 15, 23}  # PERM BUSY LOCKED NOMEM READONLY IOERR FULL CANTOPEN
#                                                       PROTOCOL AUTH


class StoreUnavailable(sqlite3.OperationalError):
    """The store cannot be opened or used right now (full disk, read-only, I/O error, lock). Nothing was moved."""


def is_corruption(path: str, error: sqlite3.DatabaseError) -> bool:
    """True only when the file itself is damaged: SQLite said CORRUPT/NOTADB, or an integrity check on a
    read-only connection fails. Environmental errors (disk full, read-only, I/O, locks) are never corruption."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        primary = code & 0xFF  # extended result codes carry the primary code in the low byte
        if primary in (SQLITE_CORRUPT, SQLITE_NOTADB):
            return True
        if primary in NOT_CORRUPTION:
            return False
    elif "locked" in str(error).lower() or "disk is full" in str(error).lower():
        return False
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return False  # cannot even open it read-only: an environment problem, keep the file
    try:
        rows = conn.execute("PRAGMA quick_check(1)").fetchall()
        return not (rows and rows[0][0] == "ok")
    except sqlite3.DatabaseError as e:
        code = getattr(e, "sqlite_errorcode", 0) & 0xFF
        return code in (SQLITE_CORRUPT, SQLITE_NOTADB) or "malformed" in str(e) or "not a database" in str(e)
    finally:
        conn.close()
