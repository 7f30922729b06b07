"""The `watch:` section: `gpuguard watch`, the daemon that follows the kernel log (gpuguard.watch.settings turns it
into the loop's settings)."""

from __future__ import annotations

from typing import Optional

from gpuguard.config.fields import Section, boolean, choice, key, number, section, string


@section
class WatchConfig(Section):
    """`watch:` what the daemon follows and how fast it reacts."""

    # kernel log the watch daemon follows; null = sources.kernel_log (on a simulated node: its kmsg file)
    source: Optional[str] = key(string(allow_none=True), None)
    # first start (no cursor yet): "boot" judges this boot's whole kernel log, "end" only new lines,
    # "auto" = boot for kmsg/journal, end for a text file (it spans boots: old lines are not this boot's)
    start_at: str = key(choice("auto", "boot", "end"), "auto")
    dedupe_window_s: float = key(number(), 300.0)  # the same Xid code on the same GPU within this is one event
    poll_interval_s: float = key(number(), 0.25)  # file sources only: how often to look for new lines
    retry_initial_s: float = key(number(), 1.0)  # a drain that failed (scontrol down) is retried after this, doubling
    retry_max_s: float = key(number(), 60.0)  # ... up to this, until it goes through
    record_non_fatal: bool = key(boolean, True)  # record app/warn-class Xids (folded by the dedupe window) in history
    # while a condition of the node stands: how often the daemon makes Slurm agree (one read of this node's state;
    # a plain `scontrol update state=resume` is drained again within this)
    agree_s: float = key(number(), 10.0)
