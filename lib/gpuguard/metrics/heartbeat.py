"""`gpuguard watch`'s liveness heartbeat: `gpuguard_watch.prom`, every `metrics.watch_heartbeat_s`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from gpuguard.metrics.monitorfiles import forward_monitor_file
from gpuguard.metrics.textfile import WATCH_FILE, Family, monitor_dir, textfile_dir, write_families

if TYPE_CHECKING:
    from gpuguard.config.schema import Config
    from gpuguard.util.log import HookLog


def watch_families(node: str, now: float, started: float, interval_s: float, up: bool,
                   pending_drains: int) -> list[Family]:
    fams = [Family("gpuguard_watch_up", "gauge", "1 while gpuguard watch runs, 0 once it stopped cleanly"),
            Family("gpuguard_watch_last_heartbeat_timestamp_seconds", "gauge",
                   "When gpuguard watch last wrote this file (every gpuguard_watch_heartbeat_interval_seconds)"),
            Family("gpuguard_watch_heartbeat_interval_seconds", "gauge", "metrics.watch_heartbeat_s"),
            Family("gpuguard_watch_start_time_seconds", "gauge", "When this gpuguard watch process started"),
            Family("gpuguard_watch_pending_drains", "gauge",
                   "Fatal Xids whose drain has not gone through yet (Slurm unreachable: retried with back-off)")]
    for fam, value in zip(fams, (1 if up else 0, now, interval_s, started, pending_drains)):
        fam.add(value, node=node)
    return fams


class WatchHeartbeat:
    """`gpuguard watch` calls `beat()` from its loop and `due_in()` to know when to wake up. Reads the config
    every time, so a reload (SIGHUP) that sets or moves `metrics.textfile_dir` takes effect. A failing write is
    logged once (not every beat) and never stops the watch. `enabled` False (`watch --once`, a one-shot scan, not
    a daemon) writes nothing."""

    def __init__(self, node: str, enabled: bool = True) -> None:
        self.node = node
        self.enabled = enabled
        self.started = time.time()
        self.next_due = 0.0  # time.monotonic() of the next beat
        self.error: Optional[str] = None

    def _settings(self, cfg: "Config") -> tuple[Optional[str], float]:
        directory = textfile_dir(cfg, self.node) if self.enabled else None
        return directory, float(cfg.metrics.watch_heartbeat_s)

    def due_in(self, cfg: "Config", now: float) -> Optional[float]:
        """Seconds until the next beat (monotonic `now`); None when metrics are off."""
        directory, _ = self._settings(cfg)
        return max(0.0, self.next_due - now) if directory else None

    def beat(self, cfg: "Config", now: float, log: "HookLog", pending_drains: int = 0, up: bool = True,
             force: bool = False) -> None:
        directory, interval = self._settings(cfg)
        if not directory or (now < self.next_due and not force):
            return
        self.next_due = now + interval
        try:
            write_families(directory, WATCH_FILE, watch_families(self.node, time.time(), self.started, interval, up,
                                                                 pending_drains))
            mdir = monitor_dir(cfg, self.node)
            if mdir and mdir != directory:  # the job monitor's series, forwarded as often as the heartbeat
                forward_monitor_file(mdir, directory, self.node)
        except Exception as e:  # noqa: BLE001 - OSError, a bad value: never stop following the kernel log
            msg = f"{type(e).__name__}: {e}"
            if msg != self.error:
                log.warning(f"watch {self.node}: cannot write the heartbeat metric in {directory}: {msg}")
            self.error = msg
        else:
            if self.error is not None:
                log.info(f"watch {self.node}: heartbeat metric written again in {directory}")
            self.error = None
