"""The watch daemon's notifications (gpuguard.notify): in threads of their own, so a slow webhook never delays
the next drain."""

from __future__ import annotations

import threading
from typing import Any

from gpuguard.config.schema import Config
from gpuguard.notify import Event, emit, enabled, flush
from gpuguard.util.log import HookLog
from gpuguard.watch.judge import CHECK_ID
from gpuguard.watch.pending import PendingEvent


def notify_enabled(cfg: Config) -> bool:
    """Any receiver configured (apprise URLs or Alertmanager)."""
    return enabled(cfg) is not None


def notify_drain(cfg: Config, node: str, p: PendingEvent, log: HookLog) -> None:
    """NOTIFY CALL SITE: the one place the watch tells people about a drain (gpuguard.notify: de-duplicated,
    grouped fleet-wide, spooled when undeliverable). In a thread: a slow webhook must not delay the next drain."""
    if not notify_enabled(cfg):
        return
    event = Event(kind="drain", node=node, message=f"{p.finding.message} (seen by gpuguard watch in the kernel log)",
                  severity="critical", check_id=CHECK_ID, action=p.finding.action.value, reason=p.reason,
                  evidence=dict(p.finding.evidence))

    def send() -> None:
        try:
            emit(cfg, event)  # bounded by its own budget, never raises
        except Exception as e:  # noqa: BLE001
            log.warning(f"watch {node}: notification failed: {type(e).__name__}: {e}")

    threading.Thread(target=send, name="gpuguard-watch-notify", daemon=True).start()


def notify_pending_drain(cfg: Config, node: str, pd: Any, log: HookLog) -> None:
    """A hook's drain that the watch applied once slurmctld answered again."""
    if not notify_enabled(cfg):
        return
    event = Event(kind="drain", node=node, severity="critical", check_id=pd.check_id, action=pd.action,
                  reason=pd.reason, message=f"drained once slurmctld answered again (decided by the {pd.origin}): "
                                            f"{pd.reason}")
    threading.Thread(target=lambda: emit(cfg, event), name="gpuguard-watch-notify", daemon=True).start()


def notify_flush(cfg: Config, log: HookLog) -> None:
    """Retry notifications that could not be delivered earlier (network down, webhook timing out)."""
    try:
        flush(cfg)
    except Exception as e:  # noqa: BLE001
        log.warning(f"watch: retrying spooled notifications failed: {type(e).__name__}: {e}")
