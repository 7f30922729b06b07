"""The `notify:` section: notifications (apprise receivers) and alerts (Alertmanager); docs/alerts.md."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from gpuguard.config.fields import Section, boolean, choice, integer, key, number, section, secret_list, string, \
    str_list


def alertmanager_urls(x: Any) -> Any:
    """notify.alertmanager_urls: http(s) URLs naming a host; errors show them with passwords masked."""
    from urllib.parse import urlsplit

    from gpuguard.util.redact import redact_url

    for url in secret_list(x):
        try:
            u = urlsplit(url.strip())
            u.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:  # urlsplit's message may quote a piece of the URL
            raise ValueError(f"not a valid URL (host or port does not parse): {redact_url(url)}") from None
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            raise ValueError(f"expected http(s)://HOST:PORT[/prefix] (no query), got {redact_url(url)}")
    return [u.strip() for u in x]


@section
class NotifyConfig(Section):
    """`notify:` who hears about what, how often."""

    # keys that existed once: a clear word instead of "unknown key"
    REMOVED: ClassVar[dict[str, str]] = {
        "shared_dir": "removed: fleet-wide grouping is Alertmanager's job now (notify.alertmanager_urls and "
                      "observability/alertmanager.yml; docs/alerts.md)",
        "group_threshold": "removed with notify.shared_dir (Alertmanager groups alerts: docs/alerts.md)",
        "group_window_s": "removed with notify.shared_dir (Alertmanager's group_wait/group_interval)",
        "trusted_user": "removed: root trusts only root-owned notification state (docs/alerts.md)",
    }

    # apprise URLs (json://, slack://, mailto://, sns://, ...); none = apprise off, nothing imported
    urls: list[str] = key(secret_list, [])
    # Alertmanager(s) gpuguard posts its alerts to (POST /api/v2/alerts): every URL gets every alert (an HA
    # pair: list both). http(s)://[user:password@]HOST:PORT[/route-prefix]
    alertmanager_urls: list[str] = key(alertmanager_urls, [])
    # the `cluster` label of every alert (several clusters, one AM)
    cluster: Optional[str] = key(string(allow_none=True), None)
    # base URL of docs/runbooks.md: annotation <url>#<check>
    runbook_url: Optional[str] = key(string(allow_none=True), None)
    # a firing alert is re-posted by flush() at most this often; it ends by itself alertmanager_ttl_s after the
    # last post (null: 4x the longer of this and metrics.healthcheck_interval_s)
    alertmanager_resend_s: float = key(number(), 60.0)
    alertmanager_ttl_s: Optional[float] = key(number(allow_none=True), None)
    min_severity: str = key(choice("info", "warning", "critical"), "info")
    kinds: list[str] = key(str_list, ["drain", "undrain", "prolog_failure", "straggler", "hang", "requeue",
                                      "internal_error", "flapping", "resource", "unknown_xid", "storm", "mismatch",
                                      "gave_up", "network"])  # resource: monitor thresholds
    # one message per episode (node/GPU + check, until resolved); an episode nothing has repeated or resolved
    # for this long is over (the fallback for alerts that never resolve)
    dedup_window_s: float = key(number(0, strict=False), 3600.0)
    send_resolved: bool = key(boolean, True)  # a "resolved" message with the alert's dedup key when it clears
    # at most rate_limit messages per rate_window_s from one state file; the rest go out as one digest
    rate_limit: int = key(integer(1), 10)
    rate_window_s: float = key(number(), 600.0)
    state_path: Optional[str] = key(string(allow_none=True), None)  # SQLite spool + limiter state (default: store.path)
    # the monitor's (run as the job's user) own state; {job_dir} {job_id} {node} {uid}; null =
    # {job_dir}/gpuguard/notify/{node}.db. It never uses state_path or store.path
    user_state_path: Optional[str] = key(string(allow_none=True), None)
    timeout_s: float = key(number(), 5.0)  # one delivery attempt to one URL
    spool_max_age_h: float = key(number(), 72.0)  # undeliverable messages are retried by flush() this long
    title_prefix: str = key(string(), "gpuguard")

    @property
    def receivers(self) -> bool:
        """Anything configured to deliver to (apprise URLs or Alertmanagers)."""
        return bool(self.urls or self.alertmanager_urls)

