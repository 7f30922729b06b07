"""The central history database: connection (bounded in time, password never shown) and schema.

Tables live in their own PostgreSQL schema `gpuguard`, so the database can be shared. Every row carries the
`origin` it came from (a random id each node's SQLite store keeps in its cursors table) and its id there
(`local_id`): the primary key (origin, local_id) makes shipping idempotent (`INSERT ... ON CONFLICT DO NOTHING`).
The node name is a column, not the key: a store recreated after corruption restarts its row ids under a new
origin, and an admin host's store may record another node's undrain.

The schema is created and migrated by gpuguard (`gpuguard fleet init-db`, and idempotently by the first ship),
under an advisory lock so 512 nodes shipping at once migrate it once.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from gpuguard.fleet.url import redact_url

SCHEMA = "gpuguard"
_LOCK_KEY = 0x67707567756172  # pg_advisory_xact_lock key for schema migrations ("gpuguar")

# version reached -> statements, applied in order, each version in one transaction
MIGRATIONS: list[tuple[int, list[str]]] = [
    (1, [
        "CREATE SCHEMA IF NOT EXISTS gpuguard",
        """CREATE TABLE IF NOT EXISTS gpuguard.origins (
            origin uuid PRIMARY KEY,
            host text,
            store_path text,
            first_ship timestamptz NOT NULL DEFAULT now(),
            last_ship timestamptz NOT NULL DEFAULT now())""",
        """CREATE TABLE IF NOT EXISTS gpuguard.runs (
            origin uuid NOT NULL,
            local_id bigint NOT NULL,
            node text NOT NULL,
            started timestamptz NOT NULL,
            duration_ms double precision,
            kind text NOT NULL,
            job_id text,
            restart_count integer,
            profile text,
            verdict text NOT NULL,
            action text,
            reason text,
            exit_code integer,
            error text,
            boot_id text,
            shipped timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (origin, local_id))""",
        "CREATE INDEX IF NOT EXISTS runs_started ON gpuguard.runs (started)",
        "CREATE INDEX IF NOT EXISTS runs_node_started ON gpuguard.runs (node, started)",
        # only problem findings (warn / fail / incomplete) are shipped: a healthy run's 17 ok findings are not news
        """CREATE TABLE IF NOT EXISTS gpuguard.findings (
            origin uuid NOT NULL,
            run_local_id bigint NOT NULL,
            seq integer NOT NULL,
            node text NOT NULL,
            started timestamptz NOT NULL,
            check_id text NOT NULL,
            severity text NOT NULL,
            keyword text,
            gpu integer,
            action text,
            message text,
            remediation text,
            evidence jsonb,
            PRIMARY KEY (origin, run_local_id, seq))""",
        "CREATE INDEX IF NOT EXISTS findings_started ON gpuguard.findings (started)",
        "CREATE INDEX IF NOT EXISTS findings_check_started ON gpuguard.findings (check_id, started)",
        """CREATE TABLE IF NOT EXISTS gpuguard.drains (
            origin uuid NOT NULL,
            local_id bigint NOT NULL,
            node text NOT NULL,
            ts timestamptz NOT NULL,
            op text NOT NULL,
            outcome text NOT NULL,
            reason text,
            check_id text,
            keyword text,
            action text,
            run_local_id bigint,
            detail text,
            PRIMARY KEY (origin, local_id))""",
        "CREATE INDEX IF NOT EXISTS drains_ts ON gpuguard.drains (ts)",
        "CREATE INDEX IF NOT EXISTS drains_node_ts ON gpuguard.drains (node, ts)",
        "CREATE TABLE IF NOT EXISTS gpuguard.schema_version (version integer NOT NULL)",
    ]),
]
LATEST = MIGRATIONS[-1][0]


class FleetDBError(RuntimeError):
    """The central database cannot be reached or used. The message never contains the password."""


def connect(url: str, timeout_s: float = 5.0, statement_timeout_s: float = 30.0,
            application_name: str = "gpuguard") -> Any:
    """A psycopg 3 connection, never waiting longer than `timeout_s` to connect (libpq's connect_timeout is whole
    seconds, at least 2) or `statement_timeout_s` for a statement or a lock. Raises FleetDBError."""
    try:
        import psycopg
    except ImportError as e:
        raise FleetDBError(f"store.url is set but psycopg (3) is not installed: pip install 'psycopg[binary]' "
                           f"({e})") from None
    ms = max(1000, int(statement_timeout_s * 1000))
    try:
        return psycopg.connect(url, connect_timeout=max(2, math.ceil(timeout_s)), application_name=application_name,
                               options=f"-c statement_timeout={ms} -c lock_timeout={ms}",
                               keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3)
    except psycopg.Error as e:
        raise FleetDBError(f"{redact_url(url)}: {_clean_error(e, url)}") from None
    except Exception as e:  # noqa: BLE001 - a malformed conninfo is a ProgrammingError or ValueError
        raise FleetDBError(f"{redact_url(url)}: {type(e).__name__}: {_clean_error(e, url)}") from None


def _clean_error(e: BaseException, url: str) -> str:
    """psycopg's message, first line, with anything that looks like the password removed."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    from urllib.parse import parse_qsl, urlsplit

    try:
        u = urlsplit(url)
        secrets = [u.password] if u.password else []
        secrets += [v for k, v in parse_qsl(u.query) if k.lower() == "password" and v]
    except ValueError:
        secrets = []
    for s in secrets:
        text = text.replace(s, "***")
    return text


def schema_version(conn: Any) -> int:
    row = conn.execute("SELECT to_regclass('gpuguard.schema_version') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute("SELECT max(version) FROM gpuguard.schema_version").fetchone()
    return int(row[0] or 0)


def ensure_schema(conn: Any) -> tuple[int, int]:
    """Create or migrate the schema; returns (version before, version now). Cheap when up to date (one query).
    A database newer than this gpuguard is left alone (its columns are a superset)."""
    before = schema_version(conn)
    conn.commit()
    if before >= LATEST:
        return before, before
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        current = schema_version(conn)  # someone else may have migrated while we waited for the lock
        for target, statements in MIGRATIONS:
            if current < target:
                for stmt in statements:
                    conn.execute(stmt)
                conn.execute("DELETE FROM gpuguard.schema_version")
                conn.execute("INSERT INTO gpuguard.schema_version(version) VALUES (%s)", (target,))
                current = target
    return before, current


def open_fleet_db(url: str, timeout_s: float = 5.0, migrate: bool = True, **kw: Any) -> Any:
    """connect() + ensure_schema(); raises FleetDBError (with a hint when the role may not create the schema)."""
    conn = connect(url, timeout_s, **kw)
    if not migrate:
        return conn
    try:
        ensure_schema(conn)
    except Exception as e:  # noqa: BLE001 - psycopg errors: permissions, timeouts
        conn.close()
        hint = ""
        if "permission denied" in str(e).lower():
            hint = " (the role cannot create the schema: run `gpuguard fleet init-db` as the database owner once)"
        raise FleetDBError(f"{redact_url(url)}: creating the gpuguard schema: {_clean_error(e, url)}{hint}") from None
    return conn


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
