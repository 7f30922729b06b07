"""The Alertmanager receiver: gpuguard's alerts posted to Alertmanager's v2 API (`POST <url>/api/v2/alerts`), so
that Alertmanager groups them across the fleet, inhibits, silences and routes them.

How Alertmanager treats a pushed alert (prometheus.io/docs/alerting/clients): the **labels** identify it (the
same labels again are the same alert; annotations are replaced by the latest post); an alert whose `endsAt` has
passed is resolved; without `endsAt` it resolves `resolve_timeout` (5 min) after it was last received, so
clients are expected to re-send active alerts. gpuguard therefore:

- remembers every alert it posted in its notification state (`notify_am_alerts`: labels, annotations, startsAt,
  endsAt), so that a repeat, a FLAPPING escalation and the resolution (an undrain, which knows no check) post
  exactly the labels the alert fired with;
- posts a firing alert with `endsAt = now + ttl` and re-posts it from every `flush()` (health check, watch
  daemon every minute, monitor) once it is older than `notify.alertmanager_resend_s`: it stays firing while a
  gpuguard process looks after it, and ends by itself `ttl` after the last one did (a node that died);
- posts the resolution with `endsAt` = the time it resolved;
- sends every post to every URL in `notify.alertmanager_urls` (an HA pair must each get every alert); one that
  fails stays in the spool for that URL alone.

Labels (what an admin routes, groups and silences on): alertname (one per kind, ALERTNAMES), node (not for a
job-wide hang), cluster (`notify.cluster`), partition, severity, check, keyword, job_id, gpu, gpu_uuid,
gpu_serial, gpu_pci (where known). Annotations: summary, description, reason, action, runbook_url, evidence,
gpus, dedup_key. Pure functions build them; `post_alerts` is the only I/O (bounded by its timeout).
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import unquote, urlsplit, urlunsplit

from gpuguard.config.sections.notify import NotifyConfig
from gpuguard.notify.event import Event, dedupe_key
from gpuguard.notify.render import action_text, evidence_text, gpu_line, title_of
from gpuguard.slurm.reason import parse_reason
from gpuguard.util.log import escape_text
from gpuguard.util.pci import pci_key
from gpuguard.util.redact import redact_url

if TYPE_CHECKING:
    from gpuguard.config.schema import Config

ALERTNAMES = {"drain": "GpuguardDrain", "prolog_failure": "GpuguardPrologFailure",
              "straggler": "GpuguardStragglerDetected", "hang": "GpuguardHangDetected",
              "requeue": "GpuguardJobRequeued", "internal_error": "GpuguardInternalError",
              "resource": "GpuguardResourceAlarm", "unknown_xid": "GpuguardUnknownXid",
              "storm": "GpuguardDrainStormHeld", "mismatch": "GpuguardConfigMismatch", "gave_up": "GpuguardJobGaveUp",
              "network": "GpuguardNetworkFault"}
MAX_VALUE = 1024  # a label or annotation value: receivers and the UI show them whole
MAX_RESPONSE = 65536


def _value(text: Any, limit: int = MAX_VALUE) -> str:
    s = escape_text(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def keyword_of(event: Event) -> Optional[str]:
    if event.keyword:
        return event.keyword
    if event.reason:
        parsed = parse_reason(event.reason)
        return parsed.keyword if parsed else None
    return None


def gpu_idents(event: Event) -> list[dict[str, Any]]:
    """The event's GPU identities, less those at another PCI address than the one its finding names: NVML
    renumbers the GPUs it still sees when one falls off the bus, so its GPU with the lost one's index is another."""
    gpus = [g for g in event.gpus or [] if isinstance(g, dict)]
    pci = (event.evidence or {}).get("pci")
    if not pci:
        return gpus
    return [g for g in gpus if not g.get("pci_bus_id") or pci_key(str(g["pci_bus_id"])) == pci_key(str(pci))] or \
        [{"index": g["index"]} for g in gpus if "index" in g]


def _gpu_labels(event: Event) -> dict[str, str]:
    gpus = gpu_idents(event)
    if event.gpu is not None:
        gpus = [g for g in gpus if g.get("index") == event.gpu] or [{"index": event.gpu}]
    out: dict[str, str] = {}
    indices = [str(event.gpu)] if event.gpu is not None else [str(g["index"]) for g in gpus if "index" in g]
    pci = (event.evidence or {}).get("pci")  # the address the finding names (an Xid line's PCI address)
    if indices:
        out["gpu"] = ",".join(dict.fromkeys(indices))
    elif pci:  # a GPU no index is known for (fallen off the bus, never seen by NVML here): its address
        out["gpu"] = str(pci)
    for attr, label in (("uuid", "gpu_uuid"), ("serial", "gpu_serial"), ("pci_bus_id", "gpu_pci")):
        values = [str(g[attr]) for g in gpus if g.get(attr)]
        if values:
            out[label] = ",".join(values)
    if pci and "gpu_pci" not in out:
        out["gpu_pci"] = str(pci)
    return out


def alert_labels(event: Event, ncfg: NotifyConfig) -> dict[str, str]:
    """The labels that identify this event's alert. A job-wide hang has no node label: whichever node of the
    job reports or resolves it, it is one alert. Pure."""
    job_scope = event.scope == "job" and bool(event.job_id)
    labels = {"alertname": ALERTNAMES.get(event.family, "Gpuguard" + event.family.title().replace("_", "")),
              "severity": event.severity}
    if not job_scope:
        labels["node"] = event.node
    optional = {"cluster": ncfg.cluster, "partition": event.partition, "check": event.check_id,
                "keyword": keyword_of(event), "job_id": event.job_id}
    labels.update({k: str(v) for k, v in optional.items() if v})
    if event.component and event.component_kind:  # a shared part's fault: `switch=leaf7` beside component=leaf7
        labels.update(component=event.component, component_kind=event.component_kind)
        labels.setdefault(event.component_kind, event.component)
    if not job_scope:
        labels.update(_gpu_labels(event))
    return {k: _value(v, 200) for k, v in labels.items()}


def alert_annotations(event: Event, ncfg: NotifyConfig) -> dict[str, str]:
    """What a human reads in the notification (replaced by every post). Pure."""
    out = {"summary": title_of(event, ncfg.title_prefix), "description": event.message,
           "action": action_text(event), "dedup_key": dedupe_key(event, ncfg.title_prefix),
           "reported_by": event.node}
    if event.reason:
        out["reason"] = event.reason
    if event.evidence:
        out["evidence"] = evidence_text(event.evidence)
    gpus = [gpu_line(g) for g in gpu_idents(event)]
    if gpus:
        out["gpus"] = "; ".join(gpus)
    base = ncfg.runbook_url
    if base:
        out["runbook_url"] = f"{base}#{event.check_id}" if event.check_id else base
    return {k: _value(v) for k, v in out.items() if v}


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def ttl_s(cfg: Config) -> float:
    """How long a firing alert lives after its last post: `notify.alertmanager_ttl_s`, by default 4x the longest
    gap between two re-posts (the resend interval, or the health check's interval when only it flushes)."""
    ncfg = cfg.notify
    if ncfg.alertmanager_ttl_s:
        return float(ncfg.alertmanager_ttl_s)
    interval = cfg.metrics.healthcheck_interval_s or 300.0
    return 4.0 * max(float(ncfg.alertmanager_resend_s or 60.0), float(interval))


def postable(labels: dict[str, str], annotations: dict[str, str], starts: float, ends: Optional[float],
             now: float, ttl: float) -> dict[str, Any]:
    """One alert as the v2 API takes it; a firing one ends `ttl` from now unless it is posted again. Pure."""
    end = ends if ends is not None else now + ttl
    return {"labels": labels, "annotations": annotations, "startsAt": rfc3339(min(starts, end)),
            "endsAt": rfc3339(end)}


# --------------------------------------------------------------------------- I/O: one POST


def api_endpoint(url: str) -> tuple[str, Optional[str]]:
    """(the v2 alerts endpoint without userinfo, an Authorization header from user:password@ or None).
    `http://am:9093`, `http://am:9093/`, `https://host/alertmanager` (a route prefix) and a URL that already
    ends in /api/v2/alerts are all accepted."""
    u = urlsplit(url.strip())
    path = u.path.rstrip("/")
    if not path.endswith("/api/v2/alerts"):
        path += "/api/v2/alerts"
    host = u.netloc.rpartition("@")[2]
    auth = None
    if u.username is not None:
        pair = f"{unquote(u.username)}:{unquote(u.password or '')}".encode()
        auth = "Basic " + base64.b64encode(pair).decode()
    return urlunsplit((u.scheme, host, path, "", "")), auth


class PostError(Exception):
    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def post_alerts(url: str, alerts: list[dict[str, Any]], timeout_s: float) -> None:
    """POST `alerts` to one Alertmanager; raises PostError (permanent for a 4xx other than 408/429: the payload
    or the URL is wrong, retrying cannot help). Each socket operation is bounded by `timeout_s`."""
    # only when posting: urllib.request brings http.client, email and ssl (~35 ms here), never on a quiet hook
    import urllib.error
    import urllib.request

    endpoint, auth = api_endpoint(url)
    headers = {"Content-Type": "application/json", "User-Agent": "gpuguard"}
    if auth:
        headers["Authorization"] = auth
    req = urllib.request.Request(endpoint, data=json.dumps(alerts).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - http(s) only (validated)
            resp.read(MAX_RESPONSE)
    except urllib.error.HTTPError as e:
        detail = e.read(300).decode("utf-8", "replace").strip() if e.fp else ""
        raise PostError(f"{redact_url(url)}: HTTP {e.code} {_value(detail, 300)}",
                        permanent=400 <= e.code < 500 and e.code not in (408, 429)) from None
    except (OSError, ValueError) as e:  # URLError, timeouts, refused, reset, bad URL
        reason = getattr(e, "reason", e)
        raise PostError(f"{redact_url(url)}: {type(reason).__name__}: {_value(reason, 300)}") from None
