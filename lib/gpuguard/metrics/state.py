"""The node file's state (pure): what `gpuguard_node.prom` says after each run, kept in the history store (cursor
`metrics:<node>`) so that a prolog that looked at 2 GPUs does not drop the other 6 and counters keep counting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from gpuguard.model import RunResult

SEVERITY_VALUE = {"ok": 0, "skip": 0, "warn": 1, "incomplete": 2, "fail": 3}
VERDICTS = ("pass", "warn", "drain", "error", "refused")  # refused: a prolog/epilog that refused its job for a
# standing condition or a pending drain while its own checks passed (exit 1)
HOOK_KINDS = ("prolog", "epilog", "healthcheck")  # their run counters exist from the first run on, at 0
XID_SEVERITIES = ("fatal", "app", "warn", "info")  # the catalog's classes (an unknown code resolves to fatal)
# drain operations a rule counts: present from the first run, at 0
DRAIN_OPS = (("drain", "done"), ("drain", "failed"), ("undrain", "done"))
# how a hook ran (gpuguard_hook_runs_via_total): the node agent's child, its own process with no agent listening,
# or its own process because the agent that listens did not run it, by reason (gpuguard.agent.client)
VIA = ("agent", "no_agent", "refused", "agent_idle", "agent_busy", "child_lost", "unreachable", "other_user", "other")
PROBES = ("nvml", "kernel_log", "fabric", "system", "nccl", "dcgm", "efa_counters")
STATE_VERSION = 1


def state_cursor(node: str) -> str:
    return f"metrics:{node}"


@dataclass(frozen=True)
class DrainState:
    """gpuguard's own record of the drain in place on the node (history store), or none."""

    drained: bool
    check_id: str = ""
    keyword: str = ""
    since: Optional[float] = None
    gpu: str = ""  # the GPU(s) the drain is about: NVML indices, or the PCI address of one no index is known for


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


def via_label(via: Optional[str]) -> str:
    """The `via` label of a hook run from its result line's `via=` (gpuguard.agent.client's reasons): one of VIA."""
    if not via:
        return "no_agent"
    if via == "agent":
        return "agent"
    why = via[len("local("):-1] if via.startswith("local(") and via.endswith(")") else via
    if why.startswith("agent refused"):
        return "refused"
    if why.startswith(("agent did not start a child", "agent child did not take the hook")):
        return "agent_busy" if why.endswith("(busy)") else "agent_idle"
    if why.startswith(("agent child ended", "agent child gave no verdict")):
        return "child_lost"
    if why.startswith("agent unreachable"):
        return "unreachable"
    if why.startswith("agent of another user"):
        return "other_user"
    return "other"


def count_via(totals: dict[str, int], ctx: Any) -> dict[str, int]:
    """The hook runs by kind and how they ran (`via_label`), counting this run's."""
    if ctx.kind not in HOOK_KINDS:
        return totals
    key = f"{ctx.kind}|{via_label(getattr(ctx, 'via', None))}"
    return {**totals, key: totals.get(key, 0) + 1}


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
                          "config_issues": 0, "via_total": {}}
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
    verdict = "refused" if getattr(result, "refused", False) else result.verdict.outcome
    st["runs"] = {**st["runs"], ctx.kind: {
        "started": result.started, "duration_s": result.duration_s, "verdict": verdict,
        "exit_code": result.exit_code, "checks": worst, "probes": probes,
        "store_ok": not getattr(result, "store_errors", None)}}
    key = f"{ctx.kind}|{verdict}"
    st["runs_total"] = {**st["runs_total"], key: st["runs_total"].get(key, 0) + 1}
    st["via_total"] = count_via(st["via_total"], ctx)
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
