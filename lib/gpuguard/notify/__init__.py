"""Notifications: to Alertmanager (`notify.alertmanager_urls`: fleet-wide grouping, inhibition, silences,
routing) and through apprise (`notify.urls`: Slack, webhooks, e-mail, SNS, PagerDuty, Opsgenie, ...).

    emit(cfg, Event(kind="drain", node="node2", message=..., check_id="gpu.xid", action="reboot", ...), now=now)
    flush(cfg, now=now)   # retry the spool, send digests, keep firing Alertmanager alerts alive

**Episodes and dedupe keys.** Every event has a stable dedupe key (`Event.key`: `gpuguard/node2/drain`,
`gpuguard/node7/monitor.gpu_clock/gpu3/job5150`, `gpuguard/job5150/hang`, ...). An *episode* runs from the first
failure until a "resolved" message with the same key (`Event(state="resolved")`, or an `undrain`).

**Alertmanager** (`alertmanager`, `amstate`) gets every state change of an incident as one alert (labels:
alertname, node, check, keyword, severity, cluster, partition, GPU identity; endsAt when it resolves), re-posted
by `flush()` while it fires; Alertmanager groups the fleet's alerts (40 nodes drained for the same check are one
notification), inhibits, silences and routes them.

**apprise receivers** (`apprise_target`) get one message per episode (repeats are counted, not re-sent; the
resolved message says how many there were), at most `rate_limit` per `rate_window_s` (the rest in one digest):
`gate`. Each URL gets the key the way its service understands it (PagerDuty dedup_key, Opsgenie alias, a
webhook's `dedup_key`/`status`).

What cannot be delivered stays in the spool (`delivery`) and is retried by `flush()`, which the health check,
the watch daemon and the monitor call periodically. Root hooks keep that state in the history store
(`notify.state_path`, default `store.path`), opened only after `state.ensure_trusted_state` (no symlink, no
directory others can write); the monitor, run as the job's user, passes its own (`user_state_path()`).
Delivery runs in a worker thread: `emit` never blocks longer than its budget and never raises. With nothing
configured, `emit` returns "disabled" without importing apprise or opening anything. Every function takes the
time from its caller (`now`); nothing here sleeps.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuguard.notify.api import emit, enabled, flush, spool_status
    from gpuguard.notify.apprise_target import target_url
    from gpuguard.notify.event import KINDS, Event, dedupe_key
    from gpuguard.notify.render import gpu_identities, iso_utc, render, render_digest
    from gpuguard.notify.state import Untrusted, local_node, open_trusted_dir, user_state_path
    from gpuguard.slurm.hostlist import compress_hostlist

# The public names, imported on first use: the hooks load the `notify:` section (gpuguard.config.sections.notify) on
# every run, and only a run that notifies pays for the rest.
_EXPORTS = {
    "emit": "gpuguard.notify.api", "enabled": "gpuguard.notify.api", "flush": "gpuguard.notify.api",
    "spool_status": "gpuguard.notify.api", "target_url": "gpuguard.notify.apprise_target",
    "KINDS": "gpuguard.notify.event", "Event": "gpuguard.notify.event", "dedupe_key": "gpuguard.notify.event",
    "gpu_identities": "gpuguard.notify.render", "iso_utc": "gpuguard.notify.render", "render": "gpuguard.notify.render",
    "render_digest": "gpuguard.notify.render", "Untrusted": "gpuguard.notify.state",
    "local_node": "gpuguard.notify.state", "open_trusted_dir": "gpuguard.notify.state",
    "user_state_path": "gpuguard.notify.state", "compress_hostlist": "gpuguard.slurm.hostlist",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (`from gpuguard.notify import gate`) is then imported by the import system
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(__import__(module, fromlist=[name]), name)
    globals()[name] = value
    return value


class _Package(ModuleType):
    """`render` is both a public function and a submodule (gpuguard.notify.render). The import system binds a
    submodule to its package's attribute when it first loads it, which would replace the function; a public name
    keeps its function (as when this package imported everything eagerly)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
