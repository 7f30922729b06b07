"""Secrets out of everything gpuguard prints or logs: URLs (store.url, Alertmanager and apprise notification URLs),
the effective config (`gpuguard config`) and error texts that may quote a URL.

A URL is split by hand, not by `urllib.parse`: a password may hold unencoded `/`, `?`, `#` or `@`, which
urlsplit takes for the start of the path, query or fragment and then prints in clear. The rules, in order:

- userinfo is everything between `scheme://` and the **last** `@` (a host never contains one): only the user
  name is kept (`user:***@host`), and not even that when it holds a delimiter; when a password-like query
  parameter comes before that `@` (it may be part of its value), nothing but the scheme is shown;
- a query parameter keeps its value only when its name is on a short list of harmless libpq/HTTP settings
  (sslmode, port, ...); a password-like one (`password`, `sslpassword`, `token`, `...key`, ...) becomes `***`,
  any other one is dropped (a `&` inside a secret would otherwise turn its tail into a "parameter");
- the fragment is dropped;
- apprise notification URLs carry tokens anywhere (Slack's path, PagerDuty's host part): only the scheme is
  shown (`slack://***`);
- a string that is not `scheme://...`, or whose rest does not parse, is shown without userinfo or query.

Pure functions; no gpuguard imports (the hooks import this on their hot path only when printing).
"""

from __future__ import annotations

import re
from typing import Iterable
from gpuguard.util.lazyre import lazy
from urllib.parse import unquote, urlsplit

MASK = "***"
_SCHEME = lazy(r"^([A-Za-z][A-Za-z0-9+.-]{0,30})://(.*)$", re.S)
# query parameters whose values are shown as they are (libpq connection settings and timeouts): never secrets
SAFE_QUERY_KEYS = frozenset({
    "sslmode", "host", "hostaddr", "port", "dbname", "user", "connect_timeout", "application_name",
    "target_session_attrs", "gssencmode", "sslrootcert", "sslcert", "sslkey", "sslcrl", "channel_binding",
    "keepalives", "keepalives_idle", "options", "timeout", "cto", "rto",
})
_SECRET_KEY = lazy(r"pass|pwd|secret|token|key|auth|sig|cred|session", re.I)
_PLAIN_KEY = lazy(r"^[A-Za-z0-9_.-]{1,40}$")
# "?...password=" before the last '@': the '@' may be part of that value rather than end a userinfo
_QUERY_SECRET = lazy(r"\?(?:.*&)?[A-Za-z0-9_.-]*(?:pass|pwd|secret|token|key|auth|sig|cred|session)"
                           r"[A-Za-z0-9_.-]*=", re.I | re.S)


def _user_shown(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    if not user or any(c in user for c in "/?#@&=%") or not _PLAIN_KEY.match(user):
        return MASK
    return f"{user}:{MASK}" if colon else user


def _query_shown(query: str) -> str:
    out = []
    for pair in query.split("&"):
        if not pair:
            continue
        key, eq, _value = pair.partition("=")
        if not _PLAIN_KEY.match(key):
            continue  # not a parameter name: maybe the tail of a secret that held a '&'
        if key.lower() in SAFE_QUERY_KEYS and not _SECRET_KEY.search(key):
            out.append(pair)
        elif _SECRET_KEY.search(key):
            out.append(f"{key}={MASK}" if eq else key)
    return "&".join(out)


def redact_url(url: str) -> str:
    """`url` with its userinfo password, password-like query values and fragment masked; safe for logs and
    errors whatever characters the secrets contain. Pure."""
    if not isinstance(url, str):
        return MASK
    text = url.strip()
    m = _SCHEME.match(text)
    if not m:
        return "<not a URL>"
    scheme, rest = m.group(1), m.group(2)
    shown_user = ""
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        if _QUERY_SECRET.search(userinfo):
            return f"{scheme}://{MASK}"  # that '@' may sit inside a password given as a query parameter
        shown_user = _user_shown(userinfo) + "@"
    rest = rest.split("#", 1)[0]
    hostpath, qmark, query = rest.partition("?")
    if any(ord(c) < 0x20 or c == "\x7f" for c in hostpath):
        return f"{scheme}://{shown_user}<unprintable>"
    try:
        parsed = urlsplit(f"{scheme}://{hostpath}")
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return f"{scheme}://{MASK + '@' if shown_user else ''}{hostpath}"  # does not parse: no userinfo or query
    shown_query = _query_shown(query) if qmark else ""
    return f"{scheme}://{shown_user}{hostpath}" + (f"?{shown_query}" if shown_query else "")


def redact_notify_url(url: str) -> str:
    """An apprise notification URL: tokens may sit in any part (Slack's path, PagerDuty's `key@key`), so only
    the scheme is shown. Pure."""
    m = _SCHEME.match(url.strip()) if isinstance(url, str) else None
    return f"{m.group(1).lower()}://{MASK}" if m else MASK


PLAIN_SCHEMES = ("http", "https", "postgresql", "postgres")  # tokens live in userinfo / query only


def url_secrets(url: str) -> list[str]:
    """What may be secret in `url`, as written and percent-decoded: its userinfo, password-like query values,
    and for a notification URL (tokens anywhere: slack://A/B/C) everything after `scheme://`."""
    if not isinstance(url, str):
        return []
    m = _SCHEME.match(url.strip())
    scheme, rest = (m.group(1).lower(), m.group(2)) if m else ("", url)
    if scheme not in PLAIN_SCHEMES:
        found = {rest}
    else:
        found = {rest.rpartition("@")[0]} if "@" in rest else set()
        # the query after the host, and from the first '?' (an '@' may sit in a password-like value)
        for query in (rest.rpartition("@")[2].partition("?")[2], rest.partition("?")[2]):
            for pair in query.split("&"):  # a value runs to the next '&', a '#' in it included
                key, _, value = pair.partition("=")
                if _SECRET_KEY.search(key):
                    found.add(value)
    found |= {unquote(p) for p in found}
    return [p for p in found if p]


def _mask_runs(text: str, secret: str, min_len: int) -> str:
    """Every run of `text` of at least `min_len` characters that also occurs in `secret`, masked."""
    out, i = [], 0
    while i < len(text):
        n = 0
        while i + n < len(text) and text[i:i + n + 1] in secret:
            n += 1
        if n >= min_len:
            out.append(MASK)
            i += n
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def scrub(text: str, urls: Iterable[str], min_len: int = 4) -> str:
    """`text` (an exception message, a library's log line) with every piece of at least `min_len` characters
    of the secrets of `urls` masked: a library that misparses a URL quotes odd slices of it."""
    for url in urls:
        for secret in url_secrets(url):
            if len(secret) >= min_len:
                text = _mask_runs(text, secret, min_len)
    return text
