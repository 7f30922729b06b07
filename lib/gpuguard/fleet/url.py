"""The central database's URL as the fleet modules use it: what a shipping watermark belongs to (`db_fingerprint`),
and printed with its password masked (`redact_url`, gpuguard.util.redact). Validating `store.url` is the config's
(gpuguard.config.pgurl)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from gpuguard.util.redact import redact_url  # noqa: F401 - re-exported: fleet modules print store.url through it


def db_fingerprint(url: str) -> str:
    """host:port/dbname: what a shipping watermark belongs to (a new database starts shipping from the start).
    No user, no password."""
    try:
        u = urlsplit(url)
        params = dict(parse_qsl(u.query, keep_blank_values=True))
        host = u.hostname or params.get("host") or ""
        port = u.port or params.get("port") or 5432
    except ValueError:
        return url and "?"
    db = u.path.strip("/") or params.get("dbname") or ""
    return f"{host}:{port}/{db}"
