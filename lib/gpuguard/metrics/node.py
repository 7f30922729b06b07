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
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

if TYPE_CHECKING:
    from gpuguard.config.schema import Config
    from gpuguard.util.log import HookLog
    from gpuguard.model import RunResult
    from gpuguard.store.sqlite import Store

SEVERITY_VALUE = {"ok": 0, "skip": 0, "warn": 1, "incomplete": 2, "fail": 3}
VERDICTS = ("pass", "warn", "drain", "error")
HOOK_KINDS = ("prolog", "epilog", "healthcheck")  # their run counters exist from the first run on, at 0
XID_SEVERITIES = ("fatal", "app", "warn", "info")  # the catalog's classes (an unknown code resolves to fatal)
# drain operations a rule counts: present from the first run, at 0
DRAIN_OPS = (("drain", "done"), ("drain", "failed"), ("undrain", "done"))
PROBES = ("nvml", "kernel_log", "fabric", "system", "nccl", "dcgm", "efa_counters")

NODE_FILE = "node"
WATCH_FILE = "watch"
MONITOR_FILE = "monitor"
# files written by gpuguard before one file per node: their series would duplicate gpuguard_node.prom's
LEGACY_FILES = ("prolog", "epilog", "healthcheck", "manual", "xid")
STATE_VERSION = 1


def state_cursor(node: str) -> str:
    return f"metrics:{node}"


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
    section = cfg.sections.get("metrics") or {}
    d = section.get("textfile_dir")
    return d.replace("{node}", node) if d else None


def prom_path(directory: str, source: str) -> str:
    return os.path.join(directory, f"gpuguard_{source}.prom")


def render(families: Iterable[Family]) -> bytes:
    """The Prometheus text exposition format, by prometheus-client. Families without samples are left out."""
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
    from gpuguard.util.fs import atomic_write

    # the collector only reads *.prom: the temp dot-file is invisible to it until the rename
    return atomic_write(prom_path(directory, source), render(families))


def remove(directory: str, source: str) -> None:
    try:
        os.unlink(prom_path(directory, source))
    except OSError:
        pass


def _log_warning(msg: str) -> None:
    try:
        import syslog

        syslog.syslog(syslog.LOG_WARNING, f"gpuguard metrics: {msg}")
    except Exception:  # noqa: BLE001
        pass


# --------------------------------------------------------------------------- the node file: state (pure)


@dataclass(frozen=True)
class DrainState:
    """gpuguard's own record of the drain in place on the node (history store), or none."""

    drained: bool
    check_id: str = ""
    keyword: str = ""
    since: Optional[float] = None


def _event_key(ev: Any) -> tuple[Optional[int], Optional[float]]:
    return getattr(ev, "seq", None), getattr(ev, "monotonic_s", None)


def new_xid_events(events: list[Any], boot_id: Optional[str], mark: dict[str, Any],
                   kind: str) -> tuple[list[Any], dict[str, Any]]:
    """The events of this run not counted before, and the new high-water mark.

    Runs overlap: the epilog judges the job's window, which the next health check reads again; a read-only run
    (another run held the node lock) does not move the kernel-log cursor. An event is new when it is past the
    mark of its boot (kmsg sequence number, else kernel monotonic time). An event with neither is counted only
    by runs that move the node's cursor (not the epilog)."""
    same_boot = bool(boot_id) and mark.get("boot") == boot_id
    seq_mark = mark.get("seq") if same_boot else None
    mono_mark = mark.get("mono") if same_boot else None
    fresh = []
    for ev in events:
        seq, mono = _event_key(ev)
        if seq is not None:
            new = seq_mark is None or seq > seq_mark
        elif mono is not None:
            new = mono_mark is None or mono > mono_mark
        else:
            new = kind != "epilog"
        if new:
            fresh.append(ev)
    seqs = [s for s, _ in map(_event_key, fresh) if s is not None]
    monos = [m for _, m in map(_event_key, fresh) if m is not None]
    out = {"boot": boot_id, "seq": seq_mark, "mono": mono_mark}
    if seqs:
        out["seq"] = max(seqs + ([seq_mark] if seq_mark is not None else []))
    if monos:
        out["mono"] = max(monos + ([mono_mark] if mono_mark is not None else []))
    return fresh, out


def _gpu_key(g: Any) -> str:
    return str(g.uuid) if g.uuid else f"index:{g.index}"


def _gpu_entry(g: Any) -> dict[str, Any]:
    return {"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "name": g.name, "serial": g.serial,
            "ecc_corrected": g.ecc_aggregate_corrected, "ecc_uncorrected": g.ecc_aggregate_uncorrected,
            "remap_correctable": g.remapped_rows_correctable, "remap_uncorrectable": g.remapped_rows_uncorrectable,
            "retired_sbe": g.retired_pages_sbe, "retired_dbe": g.retired_pages_dbe}


def update_state(state: dict[str, Any], result: "RunResult", xid_severity: Callable[[Any], str],
                 drain_rows: list[tuple[int, str, str]]) -> dict[str, Any]:
    """The node file's state after one run (pure: the store's rows and the Xid catalog come in as arguments).

    `drain_rows`: (id, op, outcome) of the history store's drain records not counted yet (any writer: this run,
    the watch daemon, `gpuguard undrain`, the NCCL sweep)."""
    ctx = result.context
    st: dict[str, Any] = {"v": STATE_VERSION, "runs": {}, "runs_total": {}, "drains_total": {}, "drain_mark": 0,
                          "xid_total": {}, "xid_by_code": {}, "xid_mark": {}, "gpus": {}, "pending": [],
                          "config_issues": 0}
    if state.get("v") == STATE_VERSION:
        st.update({k: v for k, v in state.items() if k in st})

    worst: dict[str, int] = {}
    for f in result.findings:
        worst[f.check_id] = max(worst.get(f.check_id, 0), SEVERITY_VALUE.get(f.severity.value, 0))
    probes = {}
    for name in PROBES:
        status = getattr(getattr(result.observations, name, None), "status", None)
        if status is not None:
            probes[name] = [round(float(status.duration_s), 6), bool(status.complete)]
    st["runs"] = {**st["runs"], ctx.kind: {
        "started": result.started, "duration_s": result.duration_s, "verdict": result.verdict.outcome,
        "exit_code": result.exit_code, "checks": worst, "probes": probes,
        "store_ok": not getattr(result, "store_errors", None)}}
    key = f"{ctx.kind}|{result.verdict.outcome}"
    st["runs_total"] = {**st["runs_total"], key: st["runs_total"].get(key, 0) + 1}
    # gpuguard's own health as of this run: drains Slurm has not taken yet, the config's state
    st["pending"] = [[p.op, p.created] for p in getattr(result, "pending", [])]
    st["config_issues"] = len(getattr(result, "config_issues", []))

    drains = dict(st["drains_total"])
    for row_id, op, outcome in drain_rows:
        st["drain_mark"] = max(st["drain_mark"], int(row_id))
        if outcome == "already":  # a drain found in place: nothing was done, not an operation
            continue
        drains[f"{op}|{outcome}"] = drains.get(f"{op}|{outcome}", 0) + 1
    st["drains_total"] = drains

    kl = result.observations.kernel_log
    if kl is not None and kl.events:
        fresh, st["xid_mark"] = new_xid_events(kl.events, result.boot_id, st["xid_mark"], ctx.kind)
        total, by_code = dict(st["xid_total"]), dict(st["xid_by_code"])
        for ev in fresh:
            sev = xid_severity(ev)
            total[sev] = total.get(sev, 0) + 1
            code_key = f"{ev.code}|{sev}"
            by_code[code_key] = by_code.get(code_key, 0) + 1
        st["xid_total"], st["xid_by_code"] = total, by_code

    nvml = result.observations.nvml
    if nvml is not None and nvml.gpus:
        seen = {_gpu_key(g): {**_gpu_entry(g), "ts": result.started} for g in nvml.gpus if g.fatal_error is None}
        full_view = ctx.kind == "healthcheck" and nvml.status.complete and not nvml.init_error
        # a health check sees every GPU: one it no longer sees (fell off the bus, replaced) loses its series
        st["gpus"] = seen if full_view else {**st["gpus"], **seen}
    return st


# --------------------------------------------------------------------------- the node file: families (pure)



def _add_counters(family: Any, totals: dict[str, Any], zero_keys: list[str], label_names: tuple[str, ...],
                  **labels: Any) -> None:
    """One sample per "a|b" key of `totals`, every key of `zero_keys` present from 0 (so increase() sees the first
    event), the key's parts as `label_names`."""
    merged = {k: 0 for k in zero_keys}
    merged.update(totals)
    for key, n in sorted(merged.items()):
        family.add(n, **labels, **dict(zip(label_names, key.split("|", len(label_names) - 1))))

def node_families(st: dict[str, Any], node: str, drain: Optional[DrainState], version: str,
                  healthcheck_interval_s: float, counters: bool = True, store_ok: bool = True) -> list[Family]:
    """Every family of `gpuguard_node.prom`. `counters` False (the store could not be read) leaves out the
    counters rather than restart them from 0; `drain` None (unknown) leaves out the drain state."""
    fams: list[Family] = []

    def fam(name: str, kind: str, help_text: str) -> Family:
        f = Family(name, kind, help_text)
        fams.append(f)
        return f

    fam("gpuguard_build_info", "gauge", "gpuguard's version (always 1)").add(1, node=node, version=version)
    fam("gpuguard_healthcheck_interval_seconds", "gauge",
        "metrics.healthcheck_interval_s (slurm.conf HealthCheckInterval): the freshness alert fires after 3x this"
        ).add(healthcheck_interval_s, node=node)
    ok = fam("gpuguard_history_store_ok", "gauge",
             "1 when the history store was usable for the last run and for these metrics, 0 when not (counters are "
             "left out until it is)")
    latest = max(st["runs"].values(), key=lambda r: r["started"], default={})
    ok.add(1 if store_ok and latest.get("store_ok", True) else 0, node=node)

    pending = fam("gpuguard_pending_drains", "gauge",
                  "Drains (and reboot requests) gpuguard decided but Slurm has not taken yet: the node refuses jobs "
                  "meanwhile and every run retries them (slurmctld down or hung)")
    pending.add(len(st.get("pending") or []), node=node)
    oldest = min((float(c) for _op, c in st.get("pending") or []), default=None)
    if oldest is not None:
        fam("gpuguard_pending_drain_oldest_timestamp_seconds", "gauge",
            "When the oldest pending drain was decided (only while one is pending)").add(oldest, node=node)
    fam("gpuguard_config_issues", "gauge",
        "Problems in the config file the last run worked around (bad keys took their last good value, or the "
        "whole file was replaced by the last good one): 0 when it validated").add(st.get("config_issues", 0),
                                                                                    node=node)

    if drain is not None:
        drained = fam("gpuguard_node_drained", "gauge",
                      "1 while the node is drained by gpuguard (history store), with the check and keyword of the "
                      "drain; 0 when gpuguard has no drain in place")
        if drain.drained:
            drained.add(1, node=node, check=drain.check_id, keyword=drain.keyword)
            fam("gpuguard_node_drained_since_timestamp_seconds", "gauge",
                "When gpuguard drained the node (only while drained)").add(drain.since, node=node)
        else:
            drained.add(0, node=node)

    verdict = fam("gpuguard_run_verdict", "gauge",
                  "1 for the verdict of the last run of this kind (pass, warn, drain, error), 0 for the others")
    last = fam("gpuguard_run_last_timestamp_seconds", "gauge", "When the last run of this kind started")
    dur = fam("gpuguard_run_duration_seconds", "gauge", "Wall time of the last run of this kind")
    code = fam("gpuguard_run_exit_code", "gauge",
               "Exit code of the last run of this kind (a prolog's non-zero code refused the job)")
    sev = fam("gpuguard_check_severity", "gauge",
              "Worst result of each check in the last run of this kind: 0 ok/skip, 1 warn, 2 incomplete, 3 fail")
    pdur = fam("gpuguard_probe_duration_seconds", "gauge",
               "How long each probe took in the last run of this kind (the checks that use it wait for it)")
    pok = fam("gpuguard_probe_complete", "gauge",
              "1 when the probe finished in the last run of this kind, 0 when it timed out or failed")
    for kind, run in sorted(st["runs"].items()):
        for v in VERDICTS:
            verdict.add(1 if run["verdict"] == v else 0, node=node, kind=kind, verdict=v)
        last.add(run["started"], node=node, kind=kind)
        dur.add(run["duration_s"], node=node, kind=kind)
        code.add(run["exit_code"], node=node, kind=kind)
        for check_id, value in sorted(run["checks"].items()):
            sev.add(value, node=node, kind=kind, check=check_id)
        for probe, (seconds, complete) in sorted(run["probes"].items()):
            pdur.add(seconds, node=node, kind=kind, probe=probe)
            pok.add(1 if complete else 0, node=node, kind=kind, probe=probe)

    gpus = sorted(st["gpus"].values(), key=lambda g: (g["index"], str(g["uuid"])))
    info = fam("gpuguard_gpu_info", "gauge",
               "GPU identity as NVML reported it in the latest run that saw the GPU (always 1)")
    for g in gpus:
        info.add(1, node=node, gpu=g["index"], uuid=g["uuid"], pci_bus_id=g["pci_bus_id"], name=g["name"],
                 serial=g["serial"])
    remap = fam("gpuguard_gpu_remapped_rows", "gauge", "Remapped memory rows by cause (Ampere and newer)")
    retired = fam("gpuguard_gpu_retired_pages", "gauge", "Retired memory pages by cause (pre-Ampere)")
    for g in gpus:
        labels = dict(node=node, gpu=g["index"], uuid=g["uuid"], pci_bus_id=g["pci_bus_id"])
        remap.add(g["remap_correctable"], **labels, type="correctable")
        remap.add(g["remap_uncorrectable"], **labels, type="uncorrectable")
        retired.add(g["retired_sbe"], **labels, cause="single_bit")
        retired.add(g["retired_dbe"], **labels, cause="double_bit")
    if not counters:
        return fams

    runs = fam("gpuguard_runs_total", "counter", "gpuguard runs on this node, by kind and verdict")
    _add_counters(runs, st["runs_total"], [f"{k}|{v}" for k in HOOK_KINDS for v in VERDICTS], ("kind", "verdict"),
                  node=node)

    ops = fam("gpuguard_drain_operations_total", "counter",
              "Drain and undrain operations gpuguard attempted on this node (prolog, epilog, health check, watch, "
              "admin undrain, NCCL sweep), by outcome")
    _add_counters(ops, st["drains_total"], [f"{op}|{out}" for op, out in DRAIN_OPS], ("op", "outcome"), node=node)

    xid = fam("gpuguard_xid_events_total", "counter",
              "Xid events in the kernel log by the catalog's class (fatal, app, warn, info), each event counted once "
              "(the label is not called severity: alerts set that one)")
    _add_counters(xid, st["xid_total"], list(XID_SEVERITIES), ("class",), node=node)
    by_code = fam("gpuguard_xid_code_events_total", "counter",
                  "Xid events in the kernel log by Xid code (a code's series starts at its first event: alert on "
                  "gpuguard_xid_events_total)")
    for key, n in sorted(st["xid_by_code"].items(), key=lambda kv: int(kv[0].split("|")[0])):
        code_s, s = key.split("|", 1)
        by_code.add(n, node=node, code=code_s, **{"class": s})

    ecc = fam("gpuguard_gpu_ecc_errors_total", "counter",
              "Lifetime (aggregate, kept in the GPU's infoROM) ECC errors by type, as NVML reported them")
    for g in gpus:
        labels = dict(node=node, gpu=g["index"], uuid=g["uuid"], pci_bus_id=g["pci_bus_id"])
        ecc.add(g["ecc_corrected"], **labels, type="corrected")
        ecc.add(g["ecc_uncorrected"], **labels, type="uncorrected")
    return fams


# --------------------------------------------------------------------------- the node file: I/O


def write_run_metrics(cfg: "Config", result: "RunResult") -> None:
    """Rewrite `gpuguard_node.prom` after a prolog/epilog/health-check run. Never raises; costs nothing when
    `metrics.textfile_dir` is not set."""
    try:
        directory = textfile_dir(cfg, result.context.node)
        if not directory:
            return
        _write_run_metrics(cfg, result, directory)
    except Exception as e:  # noqa: BLE001 - metrics must never break a prolog
        _log_warning(f"{type(e).__name__}: {e}")


def _xid_severity(cfg: "Config") -> Callable[[Any], str]:
    catalog: list[Any] = []

    def severity(ev: Any) -> str:
        if not catalog:  # only when there is an event to count
            from gpuguard.xid.catalog import load_catalog

            catalog.append(load_catalog(overrides=cfg.sections["xid"]["overrides"] or None))
        return str(catalog[0].resolve(ev.code, ev.detail).severity)

    return severity


def read_drain_state(store: "Store", node: str, active: Optional[dict[str, Any]]) -> DrainState:
    """From the store's record of gpuguard's drain in place (`Store.active_drain`). Slurm keeps the first reason
    (a later run finds the node `already` drained), so the check and keyword are those of the drain that set it,
    or of the FLAPPING reason the health check pinned on it since."""
    from gpuguard.slurm.reason import parse_reason

    if active is None:
        return DrainState(False)
    row = store.drain_that_set(node, active["id"]) or active
    set_id, since, check_id, reason = row["id"], row.get("ts"), row.get("check_id"), row.get("reason")
    flapping = store.flapping_pin_after(node, set_id)
    if flapping:
        check_id, reason = flapping["check_id"] or check_id, flapping["reason"]
    parsed = parse_reason(reason or "")
    return DrainState(True, check_id or (parsed.check_id if parsed else ""), parsed.keyword if parsed else "",
                      since)


def _write_run_metrics(cfg: "Config", result: "RunResult", directory: str) -> None:
    import sqlite3

    from gpuguard import __version__
    from gpuguard.store.sqlite import Store

    node = result.context.node
    interval = float((cfg.sections.get("metrics") or {}).get("healthcheck_interval_s", 300.0))
    fams: list[Family]
    try:
        with Store(cfg.sections["store"]["path"].replace("{node}", node), timeout_s=1.0) as st:
            with st.write_transaction():  # the watch daemon and admin commands write the same store
                state = st.get_cursor(state_cursor(node)) or {}
                mark = int(state.get("drain_mark", 0)) if state.get("v") == STATE_VERSION else 0
                state = update_state(state, result, _xid_severity(cfg), st.drain_ops_after(node, mark))
                st.set_cursor(state_cursor(node), state)
                drain = read_drain_state(st, node, st.active_drain(node))
        fams = node_families(state, node, drain, __version__, interval)
    except (sqlite3.Error, OSError) as e:
        # No store: this run's results still go out, the counters stay out (restarting them from 0 would read as
        # a counter reset), and gpuguard_history_store_ok says why.
        _log_warning(f"history store unusable for metrics: {type(e).__name__}: {e}")
        fams = node_families(update_state({}, result, _xid_severity(cfg), []), node, None, __version__, interval,
                             counters=False, store_ok=False)
    write_families(directory, NODE_FILE, fams)
    for legacy in LEGACY_FILES:
        remove(directory, legacy)
    if result.context.kind == "epilog" and result.context.job_id:
        remove_monitor_file_of_job(directory, result.context.job_id)


def remove_monitor_file_of_job(directory: str, job_id: str) -> bool:
    """The epilog's backstop for a monitor that was killed (SIGKILL) before it could remove its file: remove
    `gpuguard_monitor.prom` when it belongs to this job. Returns True when removed."""
    from prometheus_client.parser import text_string_to_metric_families

    path = prom_path(directory, MONITOR_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4 * 2**20)
    except OSError:
        return False
    try:
        jobs = {s.labels.get("job_id") for fam in text_string_to_metric_families(text) for s in fam.samples}
    except ValueError:
        jobs = set()
    if str(job_id) not in jobs:
        return False
    remove(directory, MONITOR_FILE)
    return True


# --------------------------------------------------------------------------- the watch daemon's heartbeat


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
        section = cfg.sections.get("metrics") or {}
        directory = textfile_dir(cfg, self.node) if self.enabled else None
        return directory, float(section.get("watch_heartbeat_s", 30.0))

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
        except Exception as e:  # noqa: BLE001 - OSError, a bad value: never stop following the kernel log
            msg = f"{type(e).__name__}: {e}"
            if msg != self.error:
                log.warning(f"watch {self.node}: cannot write the heartbeat metric in {directory}: {msg}")
            self.error = msg
        else:
            if self.error is not None:
                log.info(f"watch {self.node}: heartbeat metric written again in {directory}")
            self.error = None
