"""Delivery to apprise URLs (`notify.urls`: Slack, webhooks, e-mail, PagerDuty, Opsgenie, SNS, ...): each URL
gets the dedupe key the way its service understands it. apprise is imported only when a message goes out."""

from __future__ import annotations

from typing import Any, Optional
from urllib.parse import quote

from gpuguard.util.redact import scrub


def _query_keys(url: str) -> set[str]:
    query = url.split("?", 1)[1] if "?" in url else ""
    return {kv.split("=", 1)[0].lower() for kv in query.split("&") if kv}


def target_url(url: str, key: Optional[str], state: str, timeout_s: Optional[float] = None) -> str:
    """The configured apprise URL with what this one message needs: the dedupe key where the service has a
    field for it, whether it resolves, and the delivery timeout. A parameter the admin set wins. Pure."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    have = _query_keys(url)
    add: list[tuple[str, str]] = []
    if key:
        if scheme == "pagerduty":  # apprise: dedup -> dedup_key; action=map resolves on a SUCCESS notification
            add += [("dedup", key), ("action", "map")]
        elif scheme == "opsgenie":  # Opsgenie de-duplicates open alerts by alias
            add += [("alias", key)]
        elif scheme in ("json", "jsons", "form", "forms", "xml", "xmls"):  # ":field=value" adds a payload field
            add += [(":dedup_key", key), (":status", state)]
    if timeout_s:
        add += [("cto", f"{timeout_s:g}"), ("rto", f"{timeout_s:g}")]
    extra = "&".join(f"{k}={quote(v, safe='')}" for k, v in add if k.lower() not in have)
    if not extra:
        return url
    return url + ("&" if "?" in url else "?") + extra


def _notify_type(apprise: Any, severity: str, state: str = "firing") -> Any:
    if state == "resolved":
        return apprise.NotifyType.SUCCESS  # PagerDuty (action=map) resolves, Opsgenie (map) closes
    return {"critical": apprise.NotifyType.FAILURE, "warning": apprise.NotifyType.WARNING}.get(
        severity, apprise.NotifyType.INFO)


def preload() -> bool:
    """Import apprise and let it discover its plugins now (~0.5 s of CPU, ~35 MB), for a process that forks the
    hooks (the node agent): a child's first page then costs only its HTTP request. Without this, every child pays
    it again, and on a busy node a drain page could miss the hook's notification budget and wait in the spool for
    the next flush. False when apprise cannot be imported (the child then reports that, as a hook process would)."""
    try:
        import apprise
    except ImportError:
        return False
    apprise.Apprise().add("json://localhost")  # parsing any URL loads every plugin: the schema table is built then
    return True


def send_apprise(url: str, title: str, body: str, severity: str, key: Optional[str], state: str,
                 timeout_s: Optional[float]) -> tuple[bool, Optional[str]]:
    """(delivered, error). An invalid URL is permanent: reported as delivered-with-error so it is not retried.
    Errors never quote the URL's secrets (a plugin's exception may contain its path or token)."""
    try:
        import apprise  # here, not at the top: ~0.2 s to import on this machine, and only a delivery needs it
    except ImportError as e:
        return False, f"apprise is not installed ({e}): pip install apprise"
    client = apprise.Apprise()
    if not client.add(target_url(url, key, state, timeout_s)):
        return True, "invalid URL"
    try:
        ok = bool(client.notify(title=title, body=body, notify_type=_notify_type(apprise, severity, state),
                                body_format=apprise.NotifyFormat.TEXT))
    except Exception as e:  # noqa: BLE001 - a plugin bug must not lose the message
        return False, scrub(f"{type(e).__name__}: {e}", [url])
    return ok, None if ok else "delivery failed"
