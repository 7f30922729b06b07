"""The `metrics:` section: Prometheus textfile metrics (node_exporter's textfile collector)."""

from __future__ import annotations

from typing import Optional

from gpuguard.config.fields import Section, key, number, section, string


@section
class MetricsConfig(Section):
    """`metrics:` where the textfiles go and how often their writers run."""

    # node_exporter --collector.textfile.directory ("{node}" = node name); null = no metrics, no cost
    textfile_dir: Optional[str] = key(string(allow_none=True), None)
    # slurm.conf HealthCheckInterval, exported so the freshness alert fires after 3x this without a health check
    healthcheck_interval_s: float = key(number(), 300.0)
    # how often `gpuguard watch` writes its liveness heartbeat (the "watch down" alert waits 3x this)
    watch_heartbeat_s: float = key(number(), 30.0)
    # where the job monitor (the job's user) writes its file, mode 1777; root forwards what passes into
    # textfile_dir (gpuguard.metrics.monitorfiles). null: the monitor writes in textfile_dir itself, which then
    # only works where users may write it, and root refuses to write in such a directory
    monitor_dir: Optional[str] = key(string(allow_none=True), None)
