"""Ending a failed SQLite transaction without hiding why it failed."""

from __future__ import annotations

from typing import Any


def rollback_if_active(conn: Any) -> None:
    """ROLLBACK, only while a transaction is open. SQLite itself rolls the transaction back on some errors (a full
    disk, an I/O error, out of memory); a ROLLBACK then fails with "cannot rollback - no transaction is active",
    and raising that from an `except` block would replace the error that says what happened."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")
