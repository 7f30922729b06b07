"""The watch daemon's settings and the names it shares with the hooks (store path, log), from the config."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from gpuguard.config.schema import Config
from gpuguard.util.log import HookLog


@dataclass
class WatchSettings:
    source: Optional[str]
    start_at: str
    dedupe_window_s: float
    poll_interval_s: float
    retry_initial_s: float
    retry_max_s: float
    agree_s: float
    record_non_fatal: bool
    scontrol_s: float
    on_failure: str

    @classmethod
    def from_config(cls, cfg: Config) -> "WatchSettings":
        w = cfg.watch
        return cls(source=w.source, start_at=w.start_at, dedupe_window_s=float(w.dedupe_window_s),
                   poll_interval_s=float(w.poll_interval_s), retry_initial_s=float(w.retry_initial_s),
                   retry_max_s=float(w.retry_max_s), agree_s=float(w.agree_s), record_non_fatal=bool(w.record_non_fatal),
                   scontrol_s=float(cfg.deadlines.scontrol_s),
                   on_failure=cfg.policy.on_failure)


def cursor_name(node: str) -> str:
    # separate from the prolog's `kernel_log:<node>`: each consumer judges every record once
    return f"watch:{node}"


def store_path(cfg: Config, node: str) -> str:
    return cfg.store.path_for(node)


def make_log(cfg: Config) -> HookLog:
    lg = cfg.logging
    # under systemd stderr already lands in the journal: with syslog on too, every line would be there twice
    return HookLog(lg.syslog, lg.file, lg.level, stderr=not lg.syslog or sys.stderr.isatty())
