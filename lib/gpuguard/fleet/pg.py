"""The central history database: a connection bounded in time whose errors never show the password, and the
cleaning of text for PostgreSQL. The schema is gpuguard.fleet.schema; partitions and retention
gpuguard.fleet.partitions.
"""

from __future__ import annotations

import math
from typing import Any, Optional
from urllib.parse import parse_qsl, urlsplit

from gpuguard.fleet.url import redact_url


class FleetDBError(RuntimeError):
    """The central database cannot be reached or used. The message never contains the password."""


def connect(url: str, timeout_s: float = 5.0, statement_timeout_s: float = 30.0,
            application_name: str = "gpuguard") -> Any:
    """A psycopg 3 connection, never waiting longer than `timeout_s` to connect (libpq's connect_timeout is whole
    seconds, at least 2) or `statement_timeout_s` for a statement or a lock. Raises FleetDBError.

    No server-side prepared statements (`prepare_threshold=None`): the connection also works through a
    transaction-pooling PgBouncer (docs/fleet.md), where a prepared statement could land on another server
    connection."""
    try:
        import psycopg  # optional (gpuguard[fleet]): only where PostgreSQL is talked to
    except ImportError as e:
        raise FleetDBError(f"store.url is set but psycopg (3) is not installed: pip install 'psycopg[binary]' "
                           f"({e})") from None
    ms = max(1000, int(statement_timeout_s * 1000))
    try:
        return psycopg.connect(url, connect_timeout=max(2, math.ceil(timeout_s)), application_name=application_name,
                               options=f"-c statement_timeout={ms} -c lock_timeout={ms}",
                               keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
                               prepare_threshold=None)
    except psycopg.Error as e:
        raise FleetDBError(f"{redact_url(url)}: {clean_error(e, url)}") from None
    except Exception as e:  # noqa: BLE001 - a malformed conninfo is a ProgrammingError or ValueError
        raise FleetDBError(f"{redact_url(url)}: {type(e).__name__}: {clean_error(e, url)}") from None


def clean_error(e: BaseException, url: str) -> str:
    """psycopg's message, first line, with anything that looks like the password removed."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    try:
        u = urlsplit(url)
        secrets = [u.password] if u.password else []
        secrets += [v for k, v in parse_qsl(u.query) if k.lower() == "password" and v]
    except ValueError:
        secrets = []
    for s in secrets:
        text = text.replace(s, "***")
    return text


def clean_text(value: Optional[str]) -> Optional[str]:
    """PostgreSQL text holds no NUL and only valid UTF-8: a hostile or broken string must not poison the outbox."""
    if value is None:
        return None
    s = str(value)
    if "\x00" in s:
        s = s.replace("\x00", "\\0")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        s = s.encode("utf-8", "replace").decode("utf-8")
    return s


def clean_json(value: Any) -> Any:
    """The same for JSON evidence (jsonb rejects \\u0000 too)."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(str(k)): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # NaN / inf are not JSON
    return value
