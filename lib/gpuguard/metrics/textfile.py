"""Prometheus metrics as text files for node_exporter's textfile collector (`--collector.textfile.directory`).

Every series lives in exactly one file (node_exporter refuses a scrape, or serves one of two values, when two
files carry the same series: prometheus/node_exporter#753, #1885):

- `gpuguard_node.prom`: written by every prolog, epilog and health-check run (and `gpuguard check`). The last
  run of each kind (`kind` label), check severities, probe durations, the node's drain state, GPU identity, and
  the counters (runs, drain operations, Xid events, lifetime ECC errors per GPU). Its state is kept in the history
  store (cursor `metrics:<node>`), so a prolog that looked at 2 GPUs does not drop the other 6, counters keep
  counting across runs, and every counter a rule uses starts at 0 (a series born at 1 hides its first increase
  from `increase()`).
- `gpuguard_watch.prom`: `gpuguard watch`'s liveness heartbeat, every `metrics.watch_heartbeat_s`.
- `gpuguard_monitor.prom`: the job sidecar (`gpuguard monitor`, gpuguard.monitor.metrics); removed when it exits.

Files are rendered by prometheus-client and replaced atomically (a hidden temporary file in the same directory,
then rename), so the collector never reads half a file. Units are base units (bytes, hertz, ratios 0-1, celsius,
watts, seconds). Nothing node_exporter already exports (CPU, memory, disk, network) is duplicated. Nothing is
imported and nothing is written unless `metrics.textfile_dir` is set. Names: docs/metrics.md.

The pieces: gpuguard.metrics.textfile (this module: families as data, rendering, atomic files),
gpuguard.metrics.state and gpuguard.metrics.families (the node file's state and families, pure),
gpuguard.metrics.node (writing the node file after a run), gpuguard.metrics.heartbeat (the watch's file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

from gpuguard.util.fs import atomic_write

if TYPE_CHECKING:
    from gpuguard.config.schema import Config

NODE_FILE = "node"
WATCH_FILE = "watch"
MONITOR_FILE = "monitor"
# files written by gpuguard before one file per node: their series would duplicate gpuguard_node.prom's
LEGACY_FILES = ("prolog", "epilog", "healthcheck", "manual", "xid")


@dataclass
class Family:
    """One metric family as plain data: the monitor and the hooks build these, `render` turns them into text."""

    name: str
    kind: str  # gauge | counter
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: Optional[float], **labels: Any) -> None:
        """A sample; a value of None is left out, and so is a label whose value is None or "" (Prometheus
        treats an empty label as absent)."""
        if value is not None:
            self.samples.append(({k: str(v) for k, v in labels.items() if v is not None and v != ""},
                                 float(value)))


def textfile_dir(cfg: "Config", node: str) -> Optional[str]:
    d = cfg.metrics.textfile_dir
    return d.replace("{node}", node) if d else None


def monitor_dir(cfg: "Config", node: str) -> Optional[str]:
    """Where the job monitor writes `gpuguard_monitor.prom`: `metrics.monitor_dir`, else `textfile_dir`."""
    d = cfg.metrics.monitor_dir or cfg.metrics.textfile_dir
    return d.replace("{node}", node) if d else None


def prom_path(directory: str, source: str) -> str:
    return os.path.join(directory, f"gpuguard_{source}.prom")


def prepare_render() -> None:
    """render()'s imports, done ahead (a hook renders its file while it holds the history store's lock)."""
    import prometheus_client.exposition  # noqa: F401
    import prometheus_client.metrics_core  # noqa: F401


def render(families: Iterable[Family]) -> bytes:
    """The Prometheus text exposition format, by prometheus-client. Families without samples are left out."""
    # prometheus-client only with metrics on (metrics.textfile_dir): a prolog without them never imports it
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    built = []
    for fam in families:
        if not fam.samples:
            continue
        if fam.kind == "counter":
            # prometheus-client names a counter by its base name and writes the `_total` samples itself
            base = fam.name[: -len("_total")] if fam.name.endswith("_total") else fam.name
            mf = Metric(base, fam.help, "counter")
            sample_name = base + "_total"
        else:
            mf = Metric(fam.name, fam.help, "gauge")
            sample_name = fam.name
        for labels, value in fam.samples:
            mf.samples.append(Sample(sample_name, labels, value))
        built.append(mf)

    class _Static:
        def collect(self) -> list[Any]:
            return built

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static())  # type: ignore[arg-type]
    return generate_latest(registry)


def write_families(directory: str, source: str, families: Iterable[Family]) -> str:
    """Atomically (re)write `<directory>/gpuguard_<source>.prom`. Returns its path. Raises OSError."""
    # the collector only reads *.prom: the temp dot-file is invisible to it until the rename
    return atomic_write(prom_path(directory, source), render(families), sticky_ok=False)


def remove(directory: str, source: str) -> None:
    try:
        os.unlink(prom_path(directory, source))
    except OSError:
        pass


def log_warning(msg: str) -> None:
    try:
        import syslog  # only when writing metrics failed: off the hooks' path otherwise

        syslog.syslog(syslog.LOG_WARNING, f"gpuguard metrics: {msg}")
    except Exception:  # noqa: BLE001
        pass
