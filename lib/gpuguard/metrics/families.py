"""The node file's metric families (pure): `gpuguard_node.prom` from the node file's state (gpuguard.metrics.state)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from gpuguard.metrics.state import DRAIN_OPS, HOOK_KINDS, VERDICTS, VIA, XID_SEVERITIES, DrainState
from gpuguard.metrics.textfile import Family


def _add_counters(family: Any, totals: dict[str, Any], zero_keys: list[str], label_names: tuple[str, ...],
                  **labels: Any) -> None:
    """One sample per "a|b" key of `totals`, every key of `zero_keys` present from 0 (so increase() sees the first
    event), the key's parts as `label_names`."""
    merged = {k: 0 for k in zero_keys}
    merged.update(totals)
    for key, n in sorted(merged.items()):
        family.add(n, **labels, **dict(zip(label_names, key.split("|", len(label_names) - 1))))


# Each step adds its families through `fam(name, kind, help)`, in the order they appear in the file.
NewFamily = Callable[[str, str, str], Family]


def node_families(st: dict[str, Any], node: str, drain: Optional[DrainState], version: str,
                  healthcheck_interval_s: float, counters: bool = True, store_ok: bool = True) -> list[Family]:
    """Every family of `gpuguard_node.prom`. `counters` False (the store could not be read) leaves out the
    counters rather than restart them from 0; `drain` None (unknown) leaves out the drain state."""
    fams: list[Family] = []

    def fam(name: str, kind: str, help_text: str) -> Family:
        f = Family(name, kind, help_text)
        fams.append(f)
        return f

    _gpuguard_health(fam, st, node, version, healthcheck_interval_s, store_ok)
    if drain is not None:
        _drain_state(fam, drain, node)
    _last_runs(fam, st, node)
    gpus = sorted(st["gpus"].values(), key=lambda g: (g["index"], str(g["uuid"])))
    _gpu_identity(fam, gpus, node)
    if counters:
        _counters(fam, st, gpus, node)
    return fams


def _gpuguard_health(fam: NewFamily, st: dict[str, Any], node: str, version: str, healthcheck_interval_s: float,
                     store_ok: bool) -> None:
    """gpuguard's own state: version, expected run interval, store usable, drains pending, config problems."""
    fam("gpuguard_build_info", "gauge", "gpuguard's version (always 1)").add(1, node=node, version=version)
    fam("gpuguard_healthcheck_interval_seconds", "gauge",
        "metrics.healthcheck_interval_s (slurm.conf HealthCheckInterval): the freshness alert fires after 3x this"
        ).add(healthcheck_interval_s, node=node)
    ok = fam("gpuguard_history_store_ok", "gauge",
             "1 when the history store was usable for the last run and for these metrics, 0 when not (counters are "
             "left out until it is) and when it was found damaged and replaced since (until a later good run)")
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


def _drain_state(fam: NewFamily, drain: DrainState, node: str) -> None:
    drained = fam("gpuguard_node_drained", "gauge",
                  "1 while the node is drained by gpuguard (history store), with the check and keyword of the "
                  "drain; 0 when gpuguard has no drain in place")
    if drain.drained:
        gpu = {"gpu": drain.gpu} if drain.gpu else {}  # the GPU(s) the drain is about, where known
        drained.add(1, node=node, check=drain.check_id, keyword=drain.keyword, **gpu)
        fam("gpuguard_node_drained_since_timestamp_seconds", "gauge",
            "When gpuguard drained the node (only while drained)").add(drain.since, node=node)
    else:
        drained.add(0, node=node)


def _last_runs(fam: NewFamily, st: dict[str, Any], node: str) -> None:
    """The last run of each kind: verdict, start, duration, exit code, check severities, probe timings."""
    verdict = fam("gpuguard_run_verdict", "gauge",
                  "1 for the verdict of the last run of this kind (pass, warn, drain, error; refused: a prolog or "
                  "epilog that refused its job for a standing condition or a pending drain), 0 for the others")
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


def _gpu_identity(fam: NewFamily, gpus: list[dict[str, Any]], node: str) -> None:
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


def _counters(fam: NewFamily, st: dict[str, Any], gpus: list[dict[str, Any]], node: str) -> None:
    """Runs, drain operations, Xid events and lifetime ECC errors, each counter a rule uses present from 0."""
    runs = fam("gpuguard_runs_total", "counter", "gpuguard runs on this node, by kind and verdict")
    _add_counters(runs, st["runs_total"], [f"{k}|{v}" for k in HOOK_KINDS for v in VERDICTS], ("kind", "verdict"),
                  node=node)

    via = fam("gpuguard_hook_runs_via_total", "counter",
              "Hook runs on this node by how they ran: agent (a child of the node agent), no_agent (their own process: "
              "no agent listens), or why the agent that listens did not run them (their own process, a whole "
              "interpreter start-up more): refused (its code changed, another installation, ...), agent_idle "
              "(stopped or hung: no child within 0.5 s), agent_busy (no child within 5 s on an overloaded node), "
              "child_lost (its child ended without a verdict), unreachable, other_user, other")
    _add_counters(via, st.get("via_total", {}), [f"{k}|{v}" for k in HOOK_KINDS for v in VIA], ("kind", "via"),
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
