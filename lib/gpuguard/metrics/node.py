"""Writing `gpuguard_node.prom` after a prolog, epilog or health-check run: the node file's state read and updated
in the history store in one transaction (gpuguard.metrics.state), its families (gpuguard.metrics.families) written
atomically (gpuguard.metrics.textfile). Nothing is imported or written unless `metrics.textfile_dir` is set."""

from __future__ import annotations

import json

import os
from typing import TYPE_CHECKING, Any, Callable, Optional

from gpuguard import __version__
from gpuguard.metrics.families import node_families
from gpuguard.metrics.state import STATE_VERSION, DrainState, state_cursor, update_state
from gpuguard.metrics.monitorfiles import forward_monitor_file, read_untrusted
from gpuguard.metrics.textfile import (LEGACY_FILES, MONITOR_FILE, NODE_FILE, log_warning, monitor_dir,
                                       prepare_render, prom_path, remove, textfile_dir, write_families)
from gpuguard.slurm.reason import parse_reason
from gpuguard.util.trust import open_trusted_dir

if TYPE_CHECKING:
    from gpuguard.config.schema import Config
    from gpuguard.model import RunResult
    from gpuguard.store.sqlite import Store


def write_run_metrics(cfg: "Config", result: "RunResult", store_timeout_s: float = 1.0) -> None:
    """Rewrite `gpuguard_node.prom` after a prolog/epilog/health-check run. Never raises; costs nothing when
    `metrics.textfile_dir` is not set. `store_timeout_s`: how long to wait for the history store (its counters)
    while another process writes it."""
    try:
        directory = textfile_dir(cfg, result.context.node)
        if not directory:
            return
        _write_run_metrics(cfg, result, directory, store_timeout_s)
    except Exception as e:  # noqa: BLE001 - metrics must never break a prolog
        log_warning(f"{type(e).__name__}: {e}")


def _xid_severity(cfg: "Config") -> Callable[[Any], str]:
    catalog: list[Any] = []

    def severity(ev: Any) -> str:
        if not catalog:  # only when there is an event to count
            from gpuguard.xid.catalog import load_catalog  # only with an event to count: off a quiet prolog's path

            catalog.append(load_catalog(overrides=cfg.xid.overrides or None))
        return str(catalog[0].resolve(ev.code, ev.detail).severity)

    return severity


def read_drain_state(store: "Store", node: str, active: Optional[dict[str, Any]]) -> DrainState:
    """From the store's record of gpuguard's drain in place (`Store.active_drain`). Slurm keeps the first reason
    (a later run finds the node `already` drained), so the check and keyword are those of the drain that set it,
    or of the FLAPPING reason the health check pinned on it since."""
    if active is None:
        return DrainState(False)
    row = store.drain_that_set(node, active["id"]) or active
    set_id, since, check_id, reason = row["id"], row.get("ts"), row.get("check_id"), row.get("reason")
    flapping = store.flapping_pin_after(node, set_id)
    if flapping:
        check_id, reason = flapping["check_id"] or check_id, flapping["reason"]
    parsed = parse_reason(reason or "")
    check = check_id or (parsed.check_id if parsed else "")
    return DrainState(True, check, parsed.keyword if parsed else "", since,
                      drained_gpus(store.findings_for(row["run_id"]) if row.get("run_id") else [], check))


def drained_gpus(findings: list[dict[str, Any]], check_id: str) -> str:
    """The GPUs the failing findings of the drain's check name (store rows): their indices, else the PCI address a
    finding kept for a GPU no index was known for. Pure."""
    out: list[str] = []
    for f in findings:
        if f.get("check_id") != check_id or f.get("severity") != "fail":
            continue
        if f.get("gpu") is not None:
            out.append(str(f["gpu"]))
            continue
        try:
            pci = json.loads(f.get("evidence") or "{}").get("pci")
        except (ValueError, AttributeError):
            pci = None
        if pci:
            out.append(str(pci))
    return ",".join(dict.fromkeys(out))


def _write_run_metrics(cfg: "Config", result: "RunResult", directory: str, store_timeout_s: float) -> None:
    # only with metrics.textfile_dir set: importing this module costs a prolog without metrics nothing
    import sqlite3

    from gpuguard.store import replaced
    from gpuguard.store.sqlite import Store

    node = result.context.node
    interval = float(cfg.metrics.healthcheck_interval_s)
    unwritten: Optional[OSError] = None
    prepare_render()  # its imports before the store's lock, which the file is written under
    try:
        with Store(cfg.store.path_for(node), timeout_s=store_timeout_s) as st:
            with st.write_transaction():  # the watch daemon and admin commands write the same store
                state = st.get_cursor(state_cursor(node)) or {}
                mark = int(state.get("drain_mark", 0)) if state.get("v") == STATE_VERSION else 0
                state = update_state(state, result, _xid_severity(cfg), st.drain_ops_after(node, mark))
                st.set_cursor(state_cursor(node), state)
                drain = read_drain_state(st, node, st.active_drain(node))
                # a store found damaged and replaced reads 0 until a later good run (gpuguard.store.replaced)
                store_ok, note = replaced.metric_ok(st.get_cursor(replaced.CURSOR), result.started,
                                                    not getattr(result, "store_errors", None))
                if note is not None:
                    st.set_cursor(replaced.CURSOR, note)
                # Written inside the transaction, so the file follows the store's commit order: written after it,
                # two hooks finishing together wrote in the other order and left a counter one behind (a burst of
                # 12 prologs through the agent ended with runs_total 11 until the next run). The counters are
                # committed even when the file cannot be written (the next run's file catches up).
                try:
                    write_families(directory, NODE_FILE,
                                   node_families(state, node, drain, __version__, interval, store_ok=store_ok))
                except OSError as e:
                    unwritten = e
    except (sqlite3.Error, OSError) as e:
        # No store: this run's results still go out, the counters stay out (restarting them from 0 would read as
        # a counter reset), and gpuguard_history_store_ok says why.
        log_warning(f"history store unusable for metrics: {type(e).__name__}: {e}")
        write_families(directory, NODE_FILE,
                       node_families(update_state({}, result, _xid_severity(cfg), []), node, None, __version__,
                                     interval, counters=False, store_ok=False))
    if unwritten is not None:
        raise unwritten
    for legacy in LEGACY_FILES:
        remove(directory, legacy)
    forward_monitor(cfg, node, directory, result.context.job_id if result.context.kind == "epilog" else None)


def forward_monitor(cfg: "Config", node: str, directory: str, ended_job: Optional[str] = None) -> None:
    """The monitor's series into root's directory (gpuguard.metrics.monitorfiles), after removing the file of a
    monitor of `ended_job` that was killed before it could (the epilog's backstop). Never raises."""
    mdir = monitor_dir(cfg, node) or directory
    try:
        if os.geteuid() == 0:  # a path through a user's symlink is not root's to unlink or read in
            os.close(open_trusted_dir(mdir, sticky_end=True, create=False))
        if ended_job:
            remove_monitor_file_of_job(mdir, ended_job)
        if mdir != directory:
            forward_monitor_file(mdir, directory, node)
    except Exception as e:  # noqa: BLE001 - the node file is written: the monitor's series are extra
        log_warning(f"forwarding the monitor's series from {mdir}: {type(e).__name__}: {e}")


def remove_monitor_file_of_job(directory: str, job_id: str) -> bool:
    """The epilog's backstop for a monitor that was killed (SIGKILL) before it could remove its file: remove
    `gpuguard_monitor.prom` when it belongs to this job. Returns True when removed."""
    from prometheus_client.parser import text_string_to_metric_families  # heavy: only with metrics on

    text = read_untrusted(prom_path(directory, MONITOR_FILE))  # a user's file: never through a symlink
    if text is None:
        return False
    try:
        jobs = {s.labels.get("job_id") for fam in text_string_to_metric_families(text) for s in fam.samples}
    except ValueError:
        jobs = set()
    if str(job_id) not in jobs:
        return False
    remove(directory, MONITOR_FILE)
    return True
