"""One run, end to end: context -> plan -> gather -> evaluate -> decide -> act -> record.

Probes run concurrently in daemon threads, each under its own deadline and all under the run's total
deadline: a hung GPU (NVML blocked in the driver) or a hung filesystem leaves an *incomplete* or
*timed-out* observation behind and the run goes on. The process exits with os._exit, so a thread stuck
in a C call can never keep a prolog alive.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gpuguard.checks import CheckInput, CheckSpec, param_defaults, registry, run_check
from gpuguard.config import Config
from gpuguard.context import RunContext
from gpuguard.model import (Finding, KernelLogObservation, NvmlObservation, Observations, ProbeStatus,
                            Severity, SystemObservation, FabricObservation)
from gpuguard.policy import Verdict, apply_persistence, decide, escalate_recurring
from gpuguard.profiles import Profile


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + seconds

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def bound(self, seconds: float) -> float:
        return max(0.01, min(seconds, self.remaining()))


@dataclass
class Sources:
    """Every path and tool the probes use (DESIGN: each one a parameter, so simulation can redirect it)."""

    kernel_log: str = "auto"
    boot_id_path: str = "/proc/sys/kernel/random/boot_id"
    boot_id: Optional[str] = None
    sysfs_root: str = "/sys"
    procfs_root: str = "/proc"
    fi_info: Optional[str] = "fi_info"
    nvml_library: Optional[str] = None
    nvml_env: dict[str, str] = field(default_factory=dict)
    simulated: Optional[str] = None  # scenario path when simulating


@dataclass
class RunResult:
    context: RunContext
    profile: Profile
    observations: Observations
    findings: list[Finding]
    verdict: Verdict
    exit_code: int
    duration_s: float
    started: float
    drain: Optional[dict[str, Any]] = None
    run_id: Optional[int] = None
    simulated: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    boot_id: Optional[str] = None
    undrain: Optional[dict[str, Any]] = None
    store_errors: list[str] = field(default_factory=list)  # the store could not be opened/written this run


# --------------------------------------------------------------------------- plan


def resolve_sources(cfg: Config, node: str, simulate: Optional[str] = None) -> tuple[Sources, Optional[Profile]]:
    """Real sources from config, or a simulated node's when a scenario applies to this node."""
    src = cfg.sections["sources"]
    sim_cfg = cfg.sections["simulation"]
    if simulate or sim_cfg["scenario"] or sim_cfg["scenario_dir"]:
        from gpuguard.simulate.scenario import materialize, scenario_for_node

        path = simulate or scenario_for_node(sim_cfg["scenario"], sim_cfg["scenario_dir"], node)
        assert path is not None
        workdir = sim_cfg["workdir"] or os.path.join(_state_dir(cfg), "sim")
        sim = materialize(path, os.path.join(workdir, node), fake_nvml=sim_cfg["fake_nvml"],
                          profile_dir=cfg.sections["node"]["profile_dir"])
        return Sources(kernel_log=sim.kernel_log, boot_id=sim.boot_id, sysfs_root=sim.sysfs_root,
                       procfs_root=sim.procfs_root, fi_info=sim.fi_info, nvml_library=sim.nvml_library,
                       nvml_env=sim.nvml_env, simulated=sim.scenario), sim.profile
    return Sources(kernel_log=src["kernel_log"], boot_id_path=src["boot_id_path"], sysfs_root=src["sysfs_root"],
                   procfs_root=src["procfs_root"], fi_info=src["fi_info"],
                   nvml_library=src["nvml_library"]), None


def _state_dir(cfg: Config) -> str:
    return os.path.dirname(cfg.sections["store"]["path"]) or "."


def resolve_profile(cfg: Config, node: str) -> tuple[Profile, str]:
    """(profile, how it was chosen). `auto` asks EC2 instance metadata once per boot, else `generic`."""
    from gpuguard.profiles import apply_overrides, load_profile

    ncfg = cfg.sections["node"]
    name = ncfg["profile"]
    how = "config"
    if name == "auto":
        from gpuguard.probes.imds import get_instance_type

        itype = get_instance_type(os.path.join(_state_dir(cfg), "instance-type.json"),
                                  timeout_s=cfg.sections["deadlines"]["imds_s"],
                                  endpoint=cfg.sections["sources"]["imds_endpoint"],
                                  boot_id_path=cfg.sections["sources"]["boot_id_path"])
        name, how = (itype, "ec2-metadata") if itype else ("generic", "default (not on EC2)")
        try:
            prof = load_profile(name, ncfg["profile_dir"])
        except ValueError:
            prof, how = load_profile("generic", ncfg["profile_dir"]), f"generic (no profile for {name})"
    else:
        prof = load_profile(name, ncfg["profile_dir"])
    return apply_overrides(prof, ncfg["overrides"]), how


# --------------------------------------------------------------------------- gather


@dataclass
class _Probe:
    name: str
    fn: Callable[[], Any]
    timeout_s: float
    on_timeout: Callable[[str], Any]
    # a second wait before calling it a hang (NVML without persistence mode can take many seconds to start)
    grace_s: float = 0.0


def gather(probes: list[_Probe], deadline: Deadline) -> dict[str, Any]:
    """Start every probe at once; collect each within its own deadline (and the run's)."""
    boxes: dict[str, dict[str, Any]] = {}
    threads: dict[str, tuple[threading.Thread, float]] = {}
    for p in probes:
        box: dict[str, Any] = {}
        boxes[p.name] = box

        def target(p: _Probe = p, box: dict[str, Any] = box) -> None:
            t0 = time.monotonic()
            try:
                box["value"] = p.fn()
            except BaseException as e:  # noqa: BLE001
                box["error"] = f"{type(e).__name__}: {e}"
            box["took"] = time.monotonic() - t0

        t = threading.Thread(target=target, name=f"probe-{p.name}", daemon=True)
        t.start()
        threads[p.name] = (t, time.monotonic() + deadline.bound(p.timeout_s))
    out: dict[str, Any] = {}
    for p in probes:
        t, until = threads[p.name]
        t.join(max(0.0, until - time.monotonic()))
        box = boxes[p.name]
        late = False
        if t.is_alive() and p.grace_s and deadline.remaining() > 0:
            t.join(min(p.grace_s, deadline.remaining()))  # once more: slow is not hung
            late = not t.is_alive()
        if t.is_alive():
            out[p.name] = p.on_timeout(f"{p.name} probe timed out after {p.timeout_s:g}s")
        elif "error" in box:
            out[p.name] = p.on_timeout(f"{p.name} probe error: {box['error']}")
            status = getattr(out[p.name], "status", None)
            if status is not None:
                status.timed_out = False
        else:
            out[p.name] = box.get("value")
            status = getattr(out[p.name], "status", None)
            if status is not None:
                status.duration_s = box.get("took", 0.0)
            if late and hasattr(out[p.name], "slow_answer_s"):
                out[p.name].slow_answer_s = box.get("took", 0.0)
    return out


def _timed_out(cls: type, **extra: Any) -> Callable[[str], Any]:
    def make(msg: str) -> Any:
        obj = cls(status=ProbeStatus(complete=False, error=msg, timed_out=True))
        for k, v in extra.items():
            setattr(obj, k, v)
        return obj

    return make


def build_probes(specs: list[CheckSpec], cfg: Config, ctx: RunContext, sources: Sources, profile: Profile,
                 kernel_cursor: Optional[dict[str, Any]], store: Any = None) -> list[_Probe]:
    needs = {s.needs for s in specs}
    dl = cfg.sections["deadlines"]
    probes: list[_Probe] = []
    tier_needs = needs & {"nccl", "dcgm", "efa_counters"}
    if tier_needs:
        from gpuguard.nccl.tier import simulated_tools, tier_probes
        from gpuguard.probes.efa_counters import cursor_name as efa_cursor_name

        tools = simulated_tools(os.path.join(_state_dir(cfg), "sim-tools", ctx.node), sources.simulated) \
            if sources.simulated else {}
        gpus = len(ctx.gpu_indices) if ctx.gpu_indices else (profile.gpu_count or 8)
        efa_prev = store.get_cursor(efa_cursor_name(ctx.node)) if store is not None else None
        for name, fn, timeout, cls in tier_probes(cfg.sections["nccl"], needs=tier_needs, gpus=gpus,
                                                  sysfs_root=sources.sysfs_root, boot_id=read_boot_id(sources),
                                                  efa_previous=efa_prev, **tools):
            probes.append(_Probe(name, fn, timeout, _timed_out(cls)))
    if "nvml" in needs:
        from gpuguard.probes.nvml import read_nvml

        want_procs = any(s.id in ("gpu.processes", "gpu.leftovers", "gpu.memory_released") for s in specs)
        # every GPU of the node: node-level faults are judged on all of them whatever the job asked for, and
        # Slurm's GPU ids are mapped to NVML's afterwards (gpuguard.gpumap)
        probes.append(_Probe("nvml", lambda: read_nvml(
            gpu_indices=None, nvlinks=profile.nvlinks_per_gpu, library_path=sources.nvml_library, env=sources.nvml_env or None,
            with_processes=want_procs), dl["nvml_s"], _timed_out(NvmlObservation, init_error="TIMEOUT"),
            grace_s=dl["nvml_s"]))
    if "kernel_log" in needs:
        from gpuguard.kernellog.sources import read_xid_events

        probes.append(_Probe("kernel_log", lambda: read_xid_events(
            sources.kernel_log, kernel_cursor, timeout_s=dl["kernel_log_s"], boot_id_path=sources.boot_id_path,
            boot_id=sources.boot_id), dl["kernel_log_s"] + 0.5, _timed_out(KernelLogObservation)))
    if "fabric" in needs:
        from gpuguard.probes.fabric import read_fabric

        want_fi = bool(profile.libfabric_provider) and any(
            s.id == "fabric.efa" and cfg.check_params(s.id, param_defaults(s)).get("check_provider", True)
            for s in specs)
        probes.append(_Probe("fabric", lambda: read_fabric(
            sysfs_root=sources.sysfs_root, fi_info=sources.fi_info if want_fi else None,
            timeout_s=dl["fabric_s"]), dl["fabric_s"] + 0.5, _timed_out(FabricObservation)))
    if "system" in needs:
        from gpuguard.probes.system import read_system

        disk_spec = next((s for s in specs if s.id == "sys.disk"), None)
        paths = [p["path"] for p in cfg.check_params("sys.disk", param_defaults(disk_spec))["paths"]] \
            if disk_spec else []
        probes.append(_Probe("system", lambda: read_system(paths, procfs_root=sources.procfs_root,
                                                           sysfs_root=sources.sysfs_root),
                             dl["system_s"], _timed_out(SystemObservation)))
    return probes


# --------------------------------------------------------------------------- evaluate


def evaluate(specs: list[CheckSpec], obs: Observations, cfg: Config, ctx: RunContext, profile: Profile,
             mapping: Any = None) -> list[Finding]:
    from gpuguard.checks import NODE_SCOPE

    catalog = None
    if any(s.needs == "kernel_log" for s in specs):
        from gpuguard.xid import load_catalog

        catalog = load_catalog(overrides=cfg.sections["xid"]["overrides"] or None)
    findings: list[Finding] = []
    for spec in specs:
        inp = CheckInput(profile=profile, params=cfg.check_params(spec.id, param_defaults(spec)),
                         job_gpus=None if spec.id in NODE_SCOPE else ctx.gpu_indices, kind=ctx.kind,
                         xid_catalog=catalog, unmapped_gpus=mapping.unmapped if mapping else (),
                         gpu_map_notes=mapping.notes if mapping else ())
        findings.extend(run_check(spec, obs, inp))
    return findings


def map_job_gpus(ctx: RunContext, obs: Observations, mode: str) -> tuple[RunContext, Any]:
    """The job's GPUs as NVML indices, from Slurm's ids (GRES index = minor number, or GPU-/MIG- UUIDs)."""
    if ctx.gpu_ids is None or obs.nvml is None or not obs.nvml.gpus:
        return ctx, None
    from dataclasses import replace

    from gpuguard.gpumap import resolve_job_gpus

    mapping = resolve_job_gpus(ctx.gpu_ids, obs.nvml.gpus, mode)
    return replace(ctx, gpu_indices=mapping.indices), mapping


def read_boot_id(sources: Sources) -> Optional[str]:
    if sources.boot_id:
        return sources.boot_id
    try:
        with open(sources.boot_id_path) as f:
            return f.read().strip()
    except OSError:
        return None


# --------------------------------------------------------------------------- the run


class NodeLock:
    """Serialises runs on one node (prolog, epilog, health check share the kernel-log cursor and the drain
    bookkeeping). flock: released by the kernel if the holder dies (slurmd kills a hung health check)."""

    def __init__(self, path: str, wait_s: float) -> None:
        self.path = path
        self.wait_s = wait_s
        self.fd: Optional[int] = None

    def __enter__(self) -> bool:
        import fcntl

        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        until = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() >= until:
                    return False
                time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock


def plan_for(cfg: Config, ctx: RunContext, profile: Optional[Profile] = None, store: Any = None,
             boot_id: Optional[str] = None) -> list[CheckSpec]:
    """The checks this run does: the run kind's set; an epilog of a job that died by a signal adds the node
    checks (NVLink, PCIe, fabric, ...) because a crash can be the hardware's doing; a prolog (or manual run)
    adds the optional slow tier (NCCL all_reduce, dcgmi diag) when gpuguard.nccl.tier says it is due."""
    kinds = {ctx.kind}
    if ctx.kind == "epilog" and ctx.job_exit_code in cfg.sections["epilog"]["deep_on_exit_codes"]:
        kinds.add("epilog_deep")
    if cfg.sections["nccl"]["tier_enabled"] and store is not None and profile is not None:
        from gpuguard.nccl.tier import cursor_name, job_is_exclusive, tier_due

        excl = True if ctx.kind == "manual" else job_is_exclusive(ctx.exclusive, ctx.gpu_indices, profile.gpu_count)
        due, _why = tier_due(cfg.sections["nccl"], kind=ctx.kind, exclusive=excl, boot_id=boot_id,
                             last=store.get_cursor(cursor_name(ctx.node)), now=time.time())
        if due:
            kinds.add("tier")
    return [s for s in registry() if kinds & s.kinds and cfg.check_enabled(s.id)]


def execute(ctx: RunContext, cfg: Config, *, simulate: Optional[str] = None, dry_run: bool = False,
            deadline_s: Optional[float] = None, slurm_client: Any = None,
            on_verdict: Optional[Callable[[int], None]] = None) -> RunResult:
    """Run the checks for `ctx` and act on the verdict. Raises only on internal errors (the caller
    applies the fail-open/closed policy)."""
    from gpuguard.store import GuardedStore, Store

    started = time.time()
    dl_cfg = cfg.sections["deadlines"]
    deadline = Deadline(deadline_s or dl_cfg.get(f"{ctx.kind}_s", dl_cfg["manual_s"]))
    sources, sim_profile = resolve_sources(cfg, ctx.node, simulate)
    profile, _how = (sim_profile, "scenario") if sim_profile else resolve_profile(cfg, ctx.node)
    store_path = cfg.sections["store"]["path"].replace("{node}", ctx.node)
    lock = NodeLock(f"{store_path}.{ctx.node}.lock",
                    min(cfg.sections["locking"]["wait_s"], deadline.remaining() / 3))
    with lock as locked:
        timeout_s = min(5.0, max(0.5, deadline.remaining() / 4))
        # A store that cannot be opened or written (disk full, read-only, locked) never changes the verdict.
        store = GuardedStore(lambda: Store(store_path, timeout_s=timeout_s))
        try:
            return _run_locked(ctx, cfg, sources, profile, store, deadline, started, dry_run or not locked,
                               dry_run, locked, slurm_client, on_verdict)
        finally:
            store.close()


def _run_locked(ctx: RunContext, cfg: Config, sources: Sources, profile: Profile, store: Any, deadline: Deadline,
                started: float, read_only: bool, dry_run: bool, locked: bool, slurm_client: Any,
                on_verdict: Optional[Callable[[int], None]] = None) -> RunResult:
    dl_cfg = cfg.sections["deadlines"]
    boot_id = read_boot_id(sources)
    specs = plan_for(cfg, ctx, profile, store, boot_id)
    node_cursor = f"kernel_log:{ctx.node}"
    job_cursor = f"job:{ctx.node}:{ctx.job_id}" if ctx.job_id else None
    # The epilog judges the Xids of the job's window: from where the kernel log was when its prolog ran.
    cursor = (store.get_cursor(job_cursor) if ctx.kind == "epilog" and job_cursor else None) \
        or store.get_cursor(node_cursor)

    raw = gather(build_probes(specs, cfg, ctx, sources, profile, cursor, store), deadline)
    obs = Observations(nvml=raw.get("nvml"), kernel_log=raw.get("kernel_log"), fabric=raw.get("fabric"),
                       system=raw.get("system"), nccl=raw.get("nccl"), dcgm=raw.get("dcgm"),
                       efa_counters=raw.get("efa_counters"))
    _name_processes(obs, sources.procfs_root)
    ctx, mapping = map_job_gpus(ctx, obs, cfg.sections["slurm"].get("gpu_ids", "minor"))
    notes: list[str] = [] if locked else ["another gpuguard run held the node lock: read-only run"]
    recovered = _restart_cursor_after_recreation(store, obs)
    if recovered:
        notes.append(recovered)

    if ctx.kind == "epilog" and any(s.id == "gpu.leftovers" for s in specs) and not dry_run:
        obs.cleanup = _epilog_cleanup(ctx, cfg, obs, specs, sources, profile, deadline)

    obs.now = time.time()
    replay_cursor = f"pcie_replay:{ctx.node}"
    obs.previous["pcie_replay"] = store.get_cursor(replay_cursor) or {}
    findings = evaluate(specs, obs, cfg, ctx, profile, mapping)
    if recovered:
        findings.append(Finding("gpu.xid", Severity.WARN, recovered, keyword="XID",
                                remediation="look at the kernel log of this boot for Xids before this point "
                                            "(`gpuguard xid scan`); the moved-aside store is kept for forensics",
                                evidence={"recreated_from": store.recreated_from,
                                          "corruption": store.corruption_error}))
    pol = cfg.sections["policy"]
    reboot_cfg = cfg.sections["reboot"]
    since = time.time() - reboot_cfg["window_days"] * 86400
    recurrences = {(f.check_id, f.keyword): store.previous_fault_boots(ctx.node, f.check_id, f.keyword, boot_id, since)
                   for f in findings if f.severity is Severity.FAIL and f.keyword}
    findings = escalate_recurring(findings, recurrences, reboot_cfg["escalate_after"])
    # conditions that must persist before they drain (HW slowdown): when did the current streak start?
    persist_keys = {(f.check_id, str(f.evidence["persist"]["key"])) for f in findings
                    if f.severity is Severity.FAIL and isinstance(f.evidence.get("persist"), dict)}
    # nobody looked for longer than this between two runs: the streak is broken (3 health-check intervals, >= 1 h)
    max_gap = max(3600.0, 3 * cfg.sections.get("metrics", {}).get("healthcheck_interval_s", 300.0))
    findings = apply_persistence(findings, {k: store.persist_streak_start(ctx.node, k[0], k[1], max_gap)
                                            for k in persist_keys}, time.time())
    streaks = store.incomplete_streaks(ctx.node, [f.check_id for f in findings if f.severity is Severity.INCOMPLETE])
    verdict = decide(findings, ctx.kind, on_failure=pol["on_failure"], on_incomplete=pol["on_incomplete"],
                     incomplete_escalate_after=pol["incomplete_escalate_after"], incomplete_history=streaks)

    exit_code = 1 if verdict.outcome == "drain" else 0
    if on_verdict is not None:  # the hook's watchdog exits with the verdict, whatever happens after this point
        on_verdict(exit_code)
    result = RunResult(ctx, profile, obs, findings, verdict, exit_code, 0.0, started, simulated=sources.simulated,
                       boot_id=boot_id, notes=notes)
    client: Any = None

    def slurm() -> Any:
        nonlocal client
        if client is None:
            from gpuguard.slurm import client_from_config

            client = slurm_client or client_from_config(cfg.sections["slurm"], deadline.bound(dl_cfg["scontrol_s"]))
        return client

    if verdict.outcome == "drain" and verdict.reason:
        if dry_run:
            result.drain = {"outcome": "skipped", "detail": "dry run", "reason": verdict.reason}
        else:
            from gpuguard.slurm import drain_node, request_reboot

            out = drain_node(slurm(), ctx.node, verdict.reason)
            result.drain = {"outcome": out.outcome, "detail": out.detail, "reason": verdict.reason,
                            "previous_reason": out.previous_reason}
            if out.outcome == "done" and verdict.action.value == "reboot" and reboot_cfg["auto"]:
                result.drain["reboot"] = request_reboot(slurm(), ctx.node, verdict.reason)

    result.duration_s = time.time() - started
    result.run_id = store.record_run(
        started=started, duration_ms=result.duration_s * 1000, node=ctx.node, kind=ctx.kind, job_id=ctx.job_id,
        profile=profile.name, verdict=verdict.outcome, action=verdict.action.value, reason=verdict.reason,
        exit_code=exit_code, error=None, boot_id=boot_id, findings=findings,
        restart_count=ctx.restart_count if ctx.job_id else None)
    if result.drain:
        primary = verdict.primary
        store.record_drain(node=ctx.node, op="drain", outcome=result.drain["outcome"], reason=verdict.reason,
                           check_id=primary.check_id if primary else None, action=verdict.action.value,
                           run_id=result.run_id, detail=result.drain["detail"])
    driver_seen = _driver_seen(store, ctx, sources, read_only)
    if not result.drain and ctx.kind == "healthcheck" and not read_only and cfg.sections["undrain"]["enabled"]:
        result.undrain = maybe_undrain(store, slurm, ctx.node, verdict.outcome, boot_id, cfg, result.run_id,
                                       findings=findings, driver_seen=driver_seen)
    if ctx.kind == "healthcheck" and not read_only:
        store.prune_cursors(f"job:{ctx.node}:", older_than=time.time() - 7 * 86400)  # jobs without an epilog
    if not dry_run:
        tell_humans(cfg, result, deadline)
    if ctx.kind == "healthcheck" and not read_only:
        try:  # central history + retention, bounded by store.ship_budget_s; never on a prolog's path
            from gpuguard.fleet.ship import ship_after_run

            ship_after_run(cfg, result, deadline)
        except Exception as e:  # noqa: BLE001 - shipping history must never change what the run decided
            result.notes.append(f"central history: {type(e).__name__}: {e}"[:300])

    if not read_only:
        _save_tier_cursors(store, ctx, specs, obs, boot_id)
        replays = pcie_replay_baseline(obs.previous.get("pcie_replay") or {}, obs)
        if replays is not None:
            store.set_cursor(replay_cursor, replays)
    # Cursors move only after the run is recorded (an Xid is judged at least once), never in a read-only run.
    kl = obs.kernel_log
    if kl is not None and kl.cursor is not None and kl.status.complete and not read_only:
        if ctx.kind == "epilog":
            if job_cursor:
                store.delete_cursor(job_cursor)
        else:
            store.set_cursor(node_cursor, kl.cursor)
            if ctx.kind == "prolog" and job_cursor:
                store.set_cursor(job_cursor, kl.cursor)  # where the job's window starts
    if store.errors:
        # The verdict and the exit code above stand whatever the store did. Without the store, the kernel-log
        # cursor did not move: the next run judges the same lines again (fail closed).
        result.store_errors = list(store.errors)
        result.notes.append("history store unusable, verdict from the hardware alone, nothing recorded: "
                            + "; ".join(store.errors)[:400])
    return result


def _restart_cursor_after_recreation(store: Any, obs: Observations) -> Optional[str]:
    """A store recreated from a corrupt file has lost its kernel-log cursor. Rather than judge this boot's whole
    kernel log again (re-draining a node for an Xid that was judged, and maybe repaired, long ago), the cursor
    restarts explicitly at the end of the log: the Xids already there are reported, not judged."""
    if not store.recreated_from or obs.kernel_log is None:
        return None
    skipped = obs.kernel_log.events
    obs.kernel_log.events = []
    codes = sorted({e.code for e in skipped})
    return (f"history store was corrupt (moved to {store.recreated_from}) and recreated: kernel-log cursor "
            f"restarted at the end of the log; {len(skipped)} earlier Xid line(s) not re-judged"
            + (f" (Xid {', '.join(map(str, codes))})" if codes else ""))


def pcie_replay_baseline(previous: dict[str, Any], obs: Observations, min_age_s: float = 60.0) -> Optional[dict[str, Any]]:
    """The PCIe replay counters to compare the next run with: a GPU's reading replaces its baseline once the
    baseline is at least `min_age_s` old (prologs every few seconds would otherwise never span a minute), or
    when the counter went down (driver reload / reset). None: nothing to change."""
    if obs.nvml is None or obs.now is None:
        return None
    out = dict(previous)
    changed = False
    for g in obs.nvml.gpus:
        if g.pcie_replay_counter is None:
            continue
        key = g.uuid or str(g.index)
        before = previous.get(key)
        stale = not (isinstance(before, list) and len(before) == 2) or obs.now - float(before[1]) >= min_age_s \
            or g.pcie_replay_counter < int(before[0])
        if stale:
            out[key] = [g.pcie_replay_counter, obs.now]
            changed = True
    return out if changed else None


def _save_tier_cursors(store: Any, ctx: RunContext, specs: list[CheckSpec], obs: Observations,
                       boot_id: Optional[str]) -> None:
    """EFA counters are judged as deltas since the last run; the optional tier runs once per boot (or
    interval): both remember where they were."""
    if obs.efa_counters is not None and getattr(obs.efa_counters, "cursor", None) is not None \
            and getattr(getattr(obs.efa_counters, "status", None), "complete", False):
        from gpuguard.probes.efa_counters import cursor_name as efa_cursor_name

        store.set_cursor(efa_cursor_name(ctx.node), obs.efa_counters.cursor)
    if any("tier" in s.kinds for s in specs):
        from gpuguard.nccl.tier import cursor_name, tier_cursor

        store.set_cursor(cursor_name(ctx.node), tier_cursor(boot_id, time.time()))


def run_events(result: RunResult) -> list[Any]:
    """What a human should hear about this run: a drain (or a prolog that failed a job without being able to
    drain), an undrain or the end of gpuguard's drain (both resolve the drain's alert: same dedupe key), a node
    pinned as FLAPPING. Hardware alerts name the GPUs by UUID and serial (from this run's NVML observation)."""
    from gpuguard.notify import Event, gpu_identities

    ctx, v = result.context, result.verdict
    p = v.primary
    failing = ([p] if p else []) + [f for f in v.failing if f is not p]
    gpus = gpu_identities(getattr(result.observations, "nvml", None), (f.gpu for f in failing))
    base = dict(node=ctx.node, job_id=ctx.job_id, check_id=p.check_id if p else None,
                evidence=dict(p.evidence) if p else {}, gpus=gpus)
    events = []
    drain = result.drain or {}
    if drain.get("outcome") == "done":
        events.append(Event(kind="drain", severity="critical", message=p.message if p else (v.reason or ""),
                            reason=v.reason, action=f"{v.action.value}: {p.remediation}" if p else v.action.value,
                            **base))
    elif v.outcome == "drain" and ctx.kind == "prolog" and drain.get("outcome") in ("foreign", "failed"):
        events.append(Event(kind="prolog_failure", severity="critical",
                            message=f"{p.message if p else v.reason} (drain {drain['outcome']}: {drain['detail']})",
                            reason=v.reason, action=p.remediation if p else None, **base))
    u = result.undrain or {}
    if u.get("outcome") == "done":
        events.append(Event(kind="undrain", severity="info", node=ctx.node, message=f"undrained: {u['detail']}"))
    elif u.get("outcome") == "gone":  # resumed or taken over outside gpuguard: its drain alert is over
        events.append(Event(kind="undrain", severity="info", node=ctx.node,
                            message=f"gpuguard's drain ended outside gpuguard: {u['detail']}",
                            action="none from gpuguard: the node is no longer drained by it"))
    elif u.get("outcome") == "flapping":
        events.append(Event(kind="flapping", severity="critical", node=ctx.node,
                            message=f"pinned drained as FLAPPING: {u['detail']}",
                            action="hardware inspection; then gpuguard undrain --force"))
    for code, pci in unknown_xids(result):  # warned, never drained: a human decides what the new code means
        events.append(Event(kind="unknown_xid", severity="warning", node=ctx.node, job_id=ctx.job_id,
                            check_id="gpu.xid", message=f"Xid {code} on {pci} is not in gpuguard's Xid catalog "
                            "(a newer driver?): recorded and alerted, the node was not drained",
                            evidence={"xid": code, "pci": pci}))
    return events


def unknown_xids(result: RunResult) -> list[tuple[int, str]]:
    """(code, pci) of the Xids this run saw that the catalog does not know."""
    out: dict[tuple[int, str], None] = {}
    for f in result.findings:
        if f.check_id != "gpu.xid":
            continue
        entries = [f.evidence.get("xid")] + list(f.evidence.get("xids") or [])
        for e in entries:
            if isinstance(e, dict) and e.get("catalog") == "unknown":
                out[(int(e["code"]), str(e.get("pci")))] = None
    return list(out)


def tell_humans(cfg: Config, result: RunResult, deadline: Deadline) -> None:
    """Metrics for node_exporter and notifications (gpuguard.metrics / gpuguard.notify). Both cost nothing
    when not configured, never raise and stay within the run's deadline."""
    try:
        from gpuguard.metrics import write_run_metrics

        write_run_metrics(cfg, result)
        if not (result.drain or result.undrain or result.context.kind == "healthcheck" or unknown_xids(result)):
            return  # nothing to tell: keep the healthy prolog's path free of the notify import
        events = run_events(result)
        if events or result.context.kind == "healthcheck":
            from gpuguard.notify import emit, flush

            for ev in events:
                emit(cfg, ev, budget_s=min(2.0, deadline.remaining() / 2))
            if result.context.kind == "healthcheck":  # deliver what earlier runs had to spool
                flush(cfg, budget_s=min(3.0, deadline.remaining() / 2))
    except Exception:  # noqa: BLE001 - telling humans must never change what the run decided
        pass


def _epilog_cleanup(ctx: RunContext, cfg: Config, obs: Observations, specs: list[CheckSpec], sources: Sources,
                    profile: Profile, deadline: Deadline) -> Any:
    """Terminate the job's leftover GPU processes, then look at the GPUs again."""
    from gpuguard.epilog import cleanup_leftovers

    ecfg = cfg.sections["epilog"]
    grace = min(ecfg["kill_grace_s"], deadline.remaining() / 3)
    cleanup = cleanup_leftovers(obs.nvml, ctx.gpu_indices, ctx.job_id, ctx.job_uid, grace, ecfg["kill_leftovers"])
    if cleanup.killed:
        nvml_only = [s for s in specs if s.needs == "nvml"]
        again = gather(build_probes(nvml_only, cfg, ctx, sources, profile, None, None), deadline)
        if again.get("nvml") is not None:
            obs.nvml = again["nvml"]
            _name_processes(obs, sources.procfs_root)
    # The job's private node-local scratch (gpuguard-<jobid> under epilog.scratch_dirs): removed once its processes
    # are gone. Owner-checked, never following a link (gpuguard.jobscratch); a problem is logged, never fatal.
    if ctx.job_id and ctx.job_uid is not None and ecfg.get("scratch_dirs"):
        try:
            from gpuguard.jobscratch import remove_job_scratch

            res = remove_job_scratch(ctx.job_id, ctx.job_uid, ecfg["scratch_dirs"],
                                     deadline_s=min(5.0, max(0.5, deadline.remaining() / 4)))
            if res.removed or res.skipped or res.errors or res.incomplete:
                from gpuguard.log import HookLog

                lg = cfg.sections["logging"]
                HookLog(lg["syslog"], lg["file"], lg["level"], stderr=False).log(
                    "warning" if res.skipped or res.errors or res.incomplete else "info",
                    f"epilog on {ctx.node} job {ctx.job_id}: job scratch: {res.summary()}")
        except Exception:  # noqa: BLE001 - cleaning a cache must never change the epilog's verdict
            pass
    return cleanup


def _driver_seen(store: Any, ctx: RunContext, sources: Sources, read_only: bool) -> Optional[dict[str, Any]]:
    """The health check remembers since when it sees the loaded nvidia module (gpuguard.probes.system
    .read_driver_fingerprint): {"fp": ..., "since": epoch}. `since` is 0 for the first fingerprint ever seen
    (unknown, so it can never pass for a reload after a drain) and the time of the run that first saw a new one."""
    if ctx.kind != "healthcheck":
        return None
    from gpuguard.probes.system import read_driver_fingerprint

    fp = read_driver_fingerprint(sources.sysfs_root)
    name = f"driver_fp:{ctx.node}"
    seen = store.get_cursor(name)
    if fp is None:
        return seen
    if not seen or not seen.get("fp"):
        seen = {"fp": fp, "since": 0}
    elif seen["fp"] != fp:
        seen = {"fp": fp, "since": time.time()}
    else:
        return seen
    if not read_only:
        store.set_cursor(name, seen)
    return seen


def reset_evidence(drain: dict[str, Any], store: Any, findings: list[Finding], boot_changed: bool,
                   driver_seen: Optional[dict[str, Any]]) -> Optional[str]:
    """What shows that the GPUs were reset since a reset-class drain: the nvidia module reloaded after it, or the
    driver's recovery action, non-NONE when the node was drained, back to NONE now."""
    if boot_changed:
        return "a reboot"
    if driver_seen and float(driver_seen.get("since") or 0) > float(drain["ts"]):
        return "a driver reload"
    # States only a reset clears: the driver's recovery action, a pending row remap, pending page retirement. One
    # that failed when the node was drained and is clear now shows the GPU was reset.
    drained_for = {drain.get("check_id")}
    if drain.get("run_id") is not None:
        drained_for |= {f["check_id"] for f in store.findings_for(drain["run_id"]) if f["severity"] == "fail"}
    for check_id, what in _CLEARED_ONLY_BY_RESET.items():
        now = [f for f in findings if f.check_id == check_id]
        if check_id in drained_for and now and all(f.severity is Severity.OK for f in now):
            return what
    return None


_CLEARED_ONLY_BY_RESET = {"gpu.recovery_action": "the recovery action back to NONE",
                          "gpu.ecc": "the volatile ECC error count cleared",  # volatile counters reset with the GPU
                          "gpu.row_remap": "the pending row remap applied",
                          "gpu.retired_pages": "the pending page retirement applied"}


def maybe_undrain(store: Any, slurm: Callable[[], Any], node: str, verdict: str, boot_id: Optional[str],
                  cfg: Config, run_id: Optional[int], findings: Optional[list[Finding]] = None,
                  driver_seen: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """Lift a drain gpuguard put on this node once its cause has cleared (policy.decide_undrain). Slurm is
    asked only when the store says gpuguard has a drain in place: a healthy node costs no scontrol call."""
    from gpuguard.policy import decide_undrain
    from gpuguard.reason import format_reason, parse_reason
    from gpuguard.slurm import SlurmError

    drain = store.active_drain(node)
    if drain is None:
        return None
    ucfg = cfg.sections["undrain"]
    try:
        state = slurm().get_node(node)
    except SlurmError as e:
        return {"outcome": "failed", "detail": f"reading node state: {e}"}
    if state is None:
        return {"outcome": "failed", "detail": "node unknown to Slurm"}
    window = time.time() - ucfg["window_h"] * 3600
    passes = store.consecutive_passes(node, drain["check_id"] or "", since=drain["ts"]) if drain["check_id"] else 0
    boot_changed = bool(boot_id and drain["boot_id"] and boot_id != drain["boot_id"])
    decision = decide_undrain(
        drain_action=drain["action"] or "drain", node_drained=state.drained, node_reason=state.reason,
        node_down=state.down, node_maintenance=state.maintenance, verdict=verdict, passes=passes,
        required_passes=ucfg["passes"], boot_changed=boot_changed,
        undrains_in_window=store.count_ops(node, "undrain", window), max_undrains=ucfg["max_undrains"],
        undrain_replace=ucfg["replace"],
        reset_evidence=reset_evidence(drain, store, findings or [], boot_changed, driver_seen))
    out: dict[str, Any] = {"decision": decision.action, "detail": decision.detail}
    if decision.action == "undrain":
        try:
            slurm().undrain(node)
            out["outcome"] = "done"
        except SlurmError as e:
            out["outcome"] = "failed"
            out["detail"] += f"; {e}"
        store.record_drain(node=node, op="undrain", outcome=out["outcome"], reason=state.reason,
                           check_id=drain["check_id"], action=drain["action"], run_id=run_id, detail=decision.detail)
    elif decision.action == "closed":
        out["outcome"] = "gone"
        store.record_drain(node=node, op="undrain", outcome="gone", reason=state.reason, check_id=drain["check_id"],
                           action=drain["action"], run_id=run_id, detail=decision.detail)
    elif decision.action == "flapping":
        parsed = parse_reason(state.reason or "")
        if parsed and parsed.keyword != "FLAPPING":
            n = store.count_ops(node, "undrain", window)
            reason = format_reason(parsed.check_id, "FLAPPING",
                                   f"drained again after {n} undrains in {ucfg['window_h']:g}h: {parsed.detail}",
                                   "healthcheck", "replace")
            try:
                slurm().set_reason(node, reason)
                out["outcome"] = "flapping"
            except SlurmError as e:
                out["outcome"] = "failed"
                out["detail"] += f"; {e}"
            store.record_drain(node=node, op="drain", outcome=out["outcome"], reason=reason,
                               check_id=drain["check_id"], action="replace", run_id=run_id, detail=decision.detail)
    else:
        out["outcome"] = decision.action  # wait | admin
    return out


def _name_processes(obs: Observations, procfs_root: str) -> None:
    """Fill process names for GPU processes from /proc (for the report; pids may be gone already)."""
    if obs.nvml is None:
        return
    for g in obs.nvml.gpus:
        for p in g.processes:
            if p.name:
                continue
            try:
                with open(os.path.join(procfs_root, str(p.pid), "comm")) as f:
                    p.name = f.read().strip()[:32]
            except OSError:
                pass
