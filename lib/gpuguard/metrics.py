"""Prometheus metrics as text files for node_exporter's textfile collector (`--collector.textfile.directory`).

One file per source (`gpuguard_prolog.prom`, `gpuguard_epilog.prom`, `gpuguard_healthcheck.prom`,
`gpuguard_monitor.prom`, `gpuguard_xid.prom`), rendered by prometheus-client and replaced atomically (a
temporary file in the same directory, then rename), so the collector never reads half a file.

Nothing is imported and nothing is written unless `metrics.textfile_dir` is set. Counters that must survive
across runs come from the history store (drain operations) or a store cursor (Xid events by code), so they keep
counting when a file is rewritten.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from gpuguard.config import Config
    from gpuguard.runner import RunResult

SEVERITY_VALUE = {"ok": 0, "skip": 0, "warn": 1, "incomplete": 2, "fail": 3}
VERDICTS = ("pass", "warn", "drain", "error")


@dataclass
class Family:
    """One metric family as plain data: the monitor and the hooks build these, `render` turns them into text."""

    name: str
    kind: str  # gauge | counter
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: Optional[float], **labels: Any) -> None:
        if value is not None:
            self.samples.append(({k: str(v) for k, v in labels.items()}, float(value)))


def textfile_dir(cfg: "Config", node: str) -> Optional[str]:
    section = cfg.sections.get("metrics") or {}
    d = section.get("textfile_dir")
    return d.replace("{node}", node) if d else None


def render(families: Iterable[Family]) -> bytes:
    """The Prometheus text exposition format, by prometheus-client."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import generate_latest

    built = []
    for fam in families:
        label_names = sorted({k for labels, _ in fam.samples for k in labels})
        if fam.kind == "counter":
            # prometheus-client appends _total to a counter's samples; give it the base name
            base = fam.name[: -len("_total")] if fam.name.endswith("_total") else fam.name
            mf: Any = CounterMetricFamily(base, fam.help, labels=label_names)
        else:
            mf = GaugeMetricFamily(fam.name, fam.help, labels=label_names)
        for labels, value in fam.samples:
            mf.add_metric([labels.get(n, "") for n in label_names], value)
        built.append(mf)

    class _Static:
        def collect(self) -> list[Any]:
            return built

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static())  # type: ignore[arg-type]
    return generate_latest(registry)


def write_families(directory: str, source: str, families: Iterable[Family]) -> str:
    """Atomically (re)write `<directory>/gpuguard_<source>.prom`. Returns its path. Raises OSError."""
    from gpuguard.fsutil import atomic_write

    # the collector only reads *.prom: the temp dot-file is invisible to it until the rename
    return atomic_write(os.path.join(directory, f"gpuguard_{source}.prom"), render(families))


def remove(directory: str, source: str) -> None:
    try:
        os.unlink(os.path.join(directory, f"gpuguard_{source}.prom"))
    except OSError:
        pass


# --------------------------------------------------------------------------- hook runs (prolog/epilog/health check)


def run_families(result: "RunResult", drain_ops: dict[tuple[str, str], int]) -> list[Family]:
    """Families for one hook run. Pure (the caller reads the store)."""
    ctx = result.context
    node, kind = ctx.node, ctx.kind
    verdict = result.verdict.outcome
    last_verdict = Family("gpuguard_run_verdict", "gauge",
                          "1 for the verdict of the last run of this kind (pass, warn, drain, error)")
    for v in VERDICTS:
        last_verdict.add(1.0 if v == verdict else 0.0, node=node, kind=kind, verdict=v)
    ts = Family("gpuguard_run_last_timestamp_seconds", "gauge", "When the last run of this kind started")
    ts.add(result.started, node=node, kind=kind)
    dur = Family("gpuguard_run_duration_seconds", "gauge", "Wall time of the last run of this kind")
    dur.add(result.duration_s, node=node, kind=kind)
    code = Family("gpuguard_run_exit_code", "gauge", "Exit code of the last run (non-zero: the job was refused)")
    code.add(result.exit_code, node=node, kind=kind)

    severity = Family("gpuguard_check_severity", "gauge",
                      "Worst result of each check in the last run: 0 ok/skip, 1 warn, 2 incomplete, 3 fail")
    worst: dict[str, int] = {}
    for f in result.findings:
        worst[f.check_id] = max(worst.get(f.check_id, 0), SEVERITY_VALUE.get(f.severity.value, 0))
    for check_id, value in sorted(worst.items()):
        severity.add(value, node=node, kind=kind, check=check_id)

    # Checks are pure functions (microseconds); the time is in the probes that feed them.
    probe = Family("gpuguard_probe_duration_seconds", "gauge",
                   "How long each probe took in the last run (the checks that use it wait for it)")
    complete = Family("gpuguard_probe_complete", "gauge", "1 when the probe finished, 0 when it timed out or failed")
    obs = result.observations
    for name in ("nvml", "kernel_log", "fabric", "system"):
        o = getattr(obs, name, None)
        status = getattr(o, "status", None)
        if status is not None:
            probe.add(status.duration_s, node=node, kind=kind, probe=name)
            complete.add(1.0 if status.complete else 0.0, node=node, kind=kind, probe=name)

    drains = Family("gpuguard_drain_operations_total", "counter",
                    "Drain/undrain operations gpuguard attempted on this node, by outcome (history store)")
    for (op, outcome), n in sorted(drain_ops.items()):
        drains.add(n, node=node, op=op, outcome=outcome)
    drained = Family("gpuguard_run_drained", "gauge", "1 when the last run of this kind drained the node")
    drained.add(1.0 if result.drain and result.drain.get("outcome") in ("done", "already") else 0.0,
                node=node, kind=kind)
    return [last_verdict, ts, dur, code, severity, probe, complete, drains, drained]


def xid_families(node: str, totals: dict[str, int], last_run: dict[str, int]) -> list[Family]:
    total = Family("gpuguard_xid_events_total", "counter", "Xid events seen in the kernel log, by Xid code")
    for code, n in sorted(totals.items(), key=lambda kv: int(kv[0])):
        total.add(n, node=node, code=code)
    last = Family("gpuguard_xid_events_last_run", "gauge", "Xid events found by the last run, by Xid code")
    for code, n in sorted(last_run.items(), key=lambda kv: int(kv[0])):
        last.add(n, node=node, code=code)
    return [total, last]


def write_run_metrics(cfg: "Config", result: "RunResult") -> None:
    """Write `gpuguard_<kind>.prom` (and `gpuguard_xid.prom`) for a finished prolog/epilog/health-check run.
    Never raises; costs nothing when `metrics.textfile_dir` is not set."""
    try:
        directory = textfile_dir(cfg, result.context.node)
        if not directory:
            return
        _write_run_metrics(cfg, result, directory)
    except Exception as e:  # noqa: BLE001 - metrics must never break a prolog
        try:
            import syslog

            syslog.syslog(syslog.LOG_WARNING, f"gpuguard metrics: {type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001
            pass


def _write_run_metrics(cfg: "Config", result: "RunResult", directory: str) -> None:
    from gpuguard.store import Store

    node = result.context.node
    drain_ops: dict[tuple[str, str], int] = {}
    last_run: dict[str, int] = {}
    kl = result.observations.kernel_log
    for ev in (kl.events if kl is not None else []):
        last_run[str(ev.code)] = last_run.get(str(ev.code), 0) + 1
    totals: dict[str, int] = {}
    with Store(cfg.sections["store"]["path"].replace("{node}", node), timeout_s=1.0) as st:
        for op, outcome, n in st.conn.execute(
                "SELECT op, outcome, COUNT(*) FROM drains WHERE node=? GROUP BY op, outcome", (node,)):
            drain_ops[(op, outcome)] = int(n)
        cursor_name = f"metrics_xid:{node}"
        saved = st.get_cursor(cursor_name) or {}
        totals = {str(k): int(v) for k, v in saved.items() if str(k).isdigit()}
        if last_run:
            for code, n in last_run.items():
                totals[code] = totals.get(code, 0) + n
            st.set_cursor(cursor_name, totals)
    write_families(directory, result.context.kind, run_families(result, drain_ops))
    if last_run or not os.path.exists(os.path.join(directory, "gpuguard_xid.prom")):
        write_families(directory, "xid", xid_families(node, totals, last_run))


