"""`store.url`'s validator: a PostgreSQL URL (redaction: gpuguard.util.redact). Pure (no psycopg import): the
`store:` section (gpuguard.config.sections.store) calls `validate_url` only when a url is configured."""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlsplit

from gpuguard.util.redact import redact_url

SCHEMES = ("postgresql", "postgres")


def validate_url(value: object) -> str:
    """A postgresql:// URL naming a host (in the netloc or as ?host=, e.g. a unix socket directory) and a
    database. Raises ValueError with a message that never contains the password."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a postgresql://USER@HOST[:PORT]/DATABASE URL or null, got {type(value).__name__}")
    shown = redact_url(value)
    rest = value.strip().partition("://")[2]
    if rest.count("@") > 1 or any(c in rest.rpartition("@")[0] for c in "/?#"):
        # libpq (and urlsplit) take such a password for the host, path or query and quote pieces of it in errors
        raise ValueError(f"the user or password holds an unencoded '/', '?', '#' or '@': percent-encode them "
                         f"(%2f %3f %23 %40) or keep the password in ~/.pgpass: {shown}")
    try:
        u = urlsplit(value.strip())
        u.port  # noqa: B018 - raises ValueError for a port that is not a number
        params = dict(parse_qsl(u.query, keep_blank_values=True))
    except ValueError:  # urlsplit's message may quote a piece of the URL
        raise ValueError(f"not a valid URL (host or port does not parse): {shown}") from None
    if u.scheme not in SCHEMES:
        raise ValueError(f"expected a postgresql:// URL (central history is PostgreSQL), got {shown}")
    if not (u.hostname or params.get("host")):
        raise ValueError(f"names no host (postgresql://USER@HOST/DB, or ?host=/run/postgresql for a local "
                         f"socket): {shown}")
    if not (u.path.strip("/") or params.get("dbname")):
        raise ValueError(f"names no database (postgresql://USER@HOST/DATABASE): {shown}")
    if any(c in unquote(value) for c in "\r\n\x00"):  # also percent-encoded ones: libpq decodes them
        raise ValueError(f"contains control characters: {shown}")
    return value.strip()
