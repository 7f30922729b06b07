"""The job monitor's series, forwarded by root (docs/metrics.md "Who writes what").

node_exporter's textfile collector reads one directory and serves every `*.prom` in it: a user who can write
there can change, hide or break (a duplicate series fails the scrape) any series root writes. So root's directory
(`metrics.textfile_dir`) is root's alone, and the monitor, which runs as the job's user, writes
`gpuguard_monitor.prom` in a directory of its own (`metrics.monitor_dir`, mode 1777 like /tmp). Root (every hook
run, and `gpuguard watch` every `metrics.watch_heartbeat_s`) reads that file as untrusted input and writes what
passes into its own directory as `gpuguard_monitor.prom`:

- only the monitor's own metric names (MONITOR_NAMES, disjoint from every name root writes) and labels; the
  `node` label is always this node; at most MAX_BYTES read, MAX_SAMPLES kept;
- a file that does not parse, is not a regular file (a symlink is not followed) or is gone: no monitor series.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from gpuguard.metrics.textfile import MONITOR_FILE, Family, prom_path, remove, write_families

MONITOR_NAMES = frozenset({
    "gpuguard_gpu_utilization_ratio", "gpuguard_gpu_memory_used_bytes", "gpuguard_gpu_memory_total_bytes",
    "gpuguard_gpu_temperature_celsius", "gpuguard_gpu_slowdown_temperature_celsius", "gpuguard_gpu_power_watts",
    "gpuguard_gpu_sm_clock_hertz", "gpuguard_gpu_sm_clock_max_hertz", "gpuguard_gpu_memory_clock_hertz",
    "gpuguard_gpu_clock_event_active", "gpuguard_monitor_last_sample_timestamp_seconds",
    "gpuguard_monitor_interval_seconds", "gpuguard_monitor_gpu_sampling_ok", "gpuguard_train_last_iteration",
    "gpuguard_train_last_progress_timestamp_seconds", "gpuguard_train_iteration_seconds",
    "gpuguard_monitor_cpu_seconds_total", "gpuguard_monitor_resident_memory_bytes", "gpuguard_monitor_alert"})
LABELS = frozenset({"node", "gpu", "uuid", "pci_bus_id", "reason", "job_id", "kind", "check", "severity"})
MAX_BYTES = 1 << 20
MAX_SAMPLES = 5000


def read_untrusted(path: str) -> Optional[str]:
    """The text of a regular file, never through a symlink, never blocking on a FIFO, at most MAX_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_BYTES + 1).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def sanitize(text: str, node: str) -> list[Family]:
    """The monitor's families from an untrusted text: allowed names and labels only, `node` forced, no series
    twice. Raises ValueError when it does not parse. Pure."""
    from prometheus_client.parser import text_string_to_metric_families  # only with a monitor file to forward

    fams: dict[str, Family] = {}
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    kept = 0
    for mf in text_string_to_metric_families(text):
        for s in mf.samples:
            name = s.name
            kind = "counter" if name.endswith("_total") and mf.type == "counter" else "gauge"
            if name not in MONITOR_NAMES or kept >= MAX_SAMPLES:
                continue
            labels = {k: v for k, v in s.labels.items() if k in LABELS}
            labels["node"] = node
            key = (name, frozenset(labels.items()))
            if key in seen:
                continue
            seen.add(key)
            fam = fams.setdefault(name, Family(name, kind, mf.documentation[:300] or name))
            fam.add(s.value, **labels)
            kept += 1
    return list(fams.values())


def forward_monitor_file(monitor_dir: str, textfile_dir: str, node: str) -> str:
    """Root's copy of the monitor's series: written when the monitor's file passes, removed when it is gone or
    does not parse. Returns what happened (for the log). Raises OSError from the write only."""
    if os.path.abspath(monitor_dir) == os.path.abspath(textfile_dir):
        return "same directory: nothing to forward"
    text = read_untrusted(prom_path(monitor_dir, MONITOR_FILE))
    fams: list[Family] = []
    why = "no monitor file"
    if text is not None and len(text) <= MAX_BYTES:
        try:
            fams = sanitize(text, node)
            why = f"{sum(len(f.samples) for f in fams)} monitor series forwarded"
        except ValueError as e:
            why = f"monitor file does not parse: {e}"
    elif text is not None:
        why = f"monitor file over {MAX_BYTES} bytes"
    if fams:
        write_families(textfile_dir, MONITOR_FILE, fams)
    else:
        remove(textfile_dir, MONITOR_FILE)
    return why
