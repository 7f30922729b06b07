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
    record_non_fatal: bool
    scontrol_s: float
    on_failure: str

    @classmethod
    def from_config(cls, cfg: Config) -> "WatchSettings":
        w = cfg.sections.get("watch") or {}
        return cls(source=w.get("source"), start_at=w.get("start_at", "auto"),
                   dedupe_window_s=float(w.get("dedupe_window_s", 300.0)),
                   poll_interval_s=float(w.get("poll_interval_s", 0.25)),
                   retry_initial_s=float(w.get("retry_initial_s", 1.0)),
                   retry_max_s=float(w.get("retry_max_s", 60.0)),
                   record_non_fatal=bool(w.get("record_non_fatal", True)),
                   scontrol_s=float(cfg.sections["deadlines"]["scontrol_s"]),
                   on_failure=cfg.sections["policy"]["on_failure"])


def cursor_name(node: str) -> str:
    # separate from the prolog's `kernel_log:<node>`: each consumer judges every record once
    return f"watch:{node}"


def store_path(cfg: Config, node: str) -> str:
    return str(cfg.sections["store"]["path"]).replace("{node}", node)


def make_log(cfg: Config) -> HookLog:
    lg = cfg.sections["logging"]
    # under systemd stderr already lands in the journal: with syslog on too, every line would be there twice
    return HookLog(lg["syslog"], lg["file"], lg["level"], stderr=not lg["syslog"] or sys.stderr.isatty())
