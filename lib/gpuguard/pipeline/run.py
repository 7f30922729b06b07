"""One run, end to end: conditions -> plan -> gather -> evaluate -> decide -> commit -> act -> record.

Used by the prolog, the epilog, the health check and `gpuguard check`; the watch daemon and `gpuguard undrain`
use the same stages (gpuguard.watch, gpuguard.pipeline.admin). The order is what makes verdicts durable:

1. the node's standing conditions come first (gpuguard.pipeline.conditions): while one stands the prolog and
   epilog refuse (exit 1) whatever this run finds, and Slurm is made to agree (gpuguard.pipeline.reconcile: one
   read of this node's state; a plain resume is drained again, Slurm's own "Prolog error" replaced by gpuguard's
   reason); drains decided earlier and not applied yet (slurmctld was down) are retried;
2. gathering may use the deadline only up to the act stage's reserve (gpuguard.pipeline.budget);
3. a drain verdict becomes conditions of the node, written to the verdict journal (with a pending drain) in the
   same write that moves the kernel-log position past its evidence (commit), before Slurm is asked;
4. the history store records all of it, and nothing it fails to do changes the verdict.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from gpuguard.checks import CheckSpec
from gpuguard.config.lastgood import describe
from gpuguard.config.schema import Config
from gpuguard.context import RunContext
from gpuguard.model import Finding, Observations, PendingDrain, RunResult, Severity, Verdict
from gpuguard.pipeline.act import SlurmHandle, apply_drain, new_pending, retry_pending
from gpuguard.pipeline.budget import StageBudget
from gpuguard.pipeline.decide import is_unambiguous, judge
from gpuguard.pipeline.evaluate import evaluate, map_job_gpus, name_processes, observations_from
from gpuguard.pipeline.gather import build_probes, gather
from gpuguard.pipeline.conditions import (Condition, conditions_from_verdict, mark_applied, merge, standing,
                                          summary)
from gpuguard.pipeline.journal import Journal, journal_for, runtime_dir
from gpuguard.pipeline.positions import hook_position
from gpuguard.pipeline.reconcile import agree, clear_by_reboot
from gpuguard.pipeline.lock import NodeLock, lock_path
from gpuguard.pipeline.plan import plan_checks, resolve_profile
from gpuguard.pipeline.record import job_cursor, node_cursor, record_drains, record_run, save_cursors
from gpuguard.pipeline.sources import Sources, read_boot_id
from gpuguard.pipeline.tell import tell_humans
from gpuguard.probes.system import read_driver_fingerprint
from gpuguard.profiles import Profile
from gpuguard.store.guarded import GuardedStore, Store


def execute(ctx: RunContext, cfg: Config, sources: Sources, *, dry_run: bool = False,
            deadline_s: Optional[float] = None, slurm_client: Any = None,
            on_verdict: Optional[Callable[[int], None]] = None, log: Any = None, hook: bool = False,
            clock: Callable[[], float] = time.time) -> RunResult:
    """Run the checks for `ctx` and act on the verdict. Raises only on internal errors (the caller applies the
    fail-open/closed policy); even then, a verdict already reached has been handed to `on_verdict`. `hook`: run
    by slurmd (a HealthCheckProgram's exit code means nothing to slurmd: it drains itself and exits 0). `clock`:
    the run's one source of wall-clock time; every decision below takes `now` from it."""
    dl = cfg.deadlines
    budget = StageBudget(deadline_s or dl.for_kind(ctx.kind), dl.scontrol_s)
    profile = sources.profile or resolve_profile(cfg, ctx.node)[0]
    rundir = runtime_dir(cfg)
    store_path = cfg.store.path_for(ctx.node)
    with NodeLock(lock_path(rundir, ctx.node), min(cfg.locking.wait_s, budget.remaining() / 3),
                  fallback=f"{store_path}.{ctx.node}.lock") as locked:
        timeout_s = min(5.0, max(0.5, budget.remaining() / 4))
        # A store that cannot be opened or written (disk full, read-only, locked) never changes the verdict.
        store = GuardedStore(lambda: Store(store_path, timeout_s=timeout_s))
        try:
            run = Run(ctx, cfg, sources, profile, store, journal_for(cfg, ctx.node), budget,
                      SlurmHandle(cfg, budget, slurm_client), locked=locked, dry_run=dry_run,
                      on_verdict=on_verdict, log=log, hook=hook, clock=clock)
            return run.execute()
        finally:
            store.close()


# what making Slurm agree may have done: the node is drained for its conditions (or the drain is pending), so a
# drain verdict only adds to them
SLURM_SHOWS_IT = ("agreed", "applied", "replaced", "redrained", "admin", "pending")
STORM_SETTLE_S = 2.0  # how long a node waits for the rest of its health-check round to mark its storm intent


class Run:
    def __init__(self, ctx: RunContext, cfg: Config, sources: Sources, profile: Profile, store: Any,
                 journal: Journal, budget: StageBudget, slurm: SlurmHandle, *, locked: bool, dry_run: bool,
                 on_verdict: Optional[Callable[[int], None]], log: Any, hook: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.ctx, self.cfg, self.sources, self.profile = ctx, cfg, sources, profile
        self.store, self.journal, self.budget, self.slurm = store, journal, budget, slurm
        self.dry_run = dry_run
        self.hook = hook
        self.kept = False  # the verdict adds to conditions Slurm already shows (or has pending): Slurm is not asked
        self.read_only = dry_run or not locked
        self.on_verdict = on_verdict
        self.log = log
        self.clock = clock
        self.started = clock()
        self.boot_id = read_boot_id(sources)
        self.notes: list[str] = [] if locked else ["another gpuguard run held the node lock: read-only run"]
        self.applied: list[dict[str, Any]] = []
        self.events: list[Any] = []
        self.pending: Optional[PendingDrain] = None
        self.agreement: dict[str, Any] = {"outcome": "none"}  # what making Slurm agree with the conditions did
        self.new_conditions: list[Condition] = []
        self.storm: Any = None  # the drain-storm guard that let this run's drain go ahead (its mark goes after it)

    # ------------------------------------------------------------------ the stages, in order
    def execute(self) -> RunResult:
        self.conditions_first()
        specs, obs, mapping = self.gather()
        findings = evaluate(specs, obs, self.cfg, self.ctx, self.profile, mapping)
        findings, verdict = judge(findings, self.ctx, self.cfg, self.store, self.boot_id, self.clock(),
                                  restricted=self.cfg.restricted)
        self.clear_by_evidence(findings)
        self.make_slurm_agree()
        if verdict.outcome == "drain" and not self.dry_run:
            # conditions Slurm already shows (or a drain already pending): the new ones join them, Slurm is not asked
            self.kept = self.agreement["outcome"] in SLURM_SHOWS_IT
        self.storm_check(verdict)
        result = RunResult(self.ctx, self.profile, obs, findings, verdict, self.exit_code(verdict), 0.0,
                           self.started, simulated=self.sources.simulated, boot_id=self.boot_id, notes=self.notes)
        if self.on_verdict is not None:  # the hook's watchdog exits with the verdict, whatever happens next
            self.on_verdict(result.exit_code)
        self.note_config()
        position = self.commit(verdict, obs)
        self.act(result)
        self.record(result, specs, obs, position)
        return result

    def refuses(self) -> bool:
        """A prolog or epilog refuses its job while a condition stands or a drain is pending (or was only now
        applied), whatever this run's own checks found."""
        return self.ctx.kind in ("prolog", "epilog") and (
            bool(standing(self.journal.conditions)) or bool(self.journal.pending)
            or any(a["outcome"] in ("done", "already") for a in self.applied))

    def exit_code(self, verdict: Verdict) -> int:
        """1 when the node must not run the job: a drain verdict, a standing condition, a pending drain."""
        if self.hook and self.ctx.kind == "healthcheck":
            return 0  # slurmd only logs a HealthCheckProgram's exit code; gpuguard drained the node itself
        return 1 if verdict.outcome == "drain" or self.refuses() else 0

    def conditions_first(self) -> None:
        """Standing conditions (and pending drains) before anything else: the job is refused at once, a reboot
        clears what it clears, a drain from before conditions existed is adopted."""
        if self.dry_run:
            return
        j, now = self.journal, self.clock()
        if not self.read_only:
            cleared = clear_by_reboot(j, self.boot_id, now)
            if cleared:
                self.notes.append(f"cleared by a reboot: {summary(cleared)}")
        if self.ctx.kind == "healthcheck" and not j.conditions and not self.read_only:
            from gpuguard.pipeline.undrain import adopt_store_drain  # a health check's: not on a prolog's path

            self.agreement = adopt_store_drain(j, self.store, self.slurm, self.ctx.node, now)
        if (standing(j.conditions) or j.pending) and self.ctx.kind in ("prolog", "epilog") \
                and self.on_verdict is not None:
            self.on_verdict(1)  # a standing condition: this job must not start, whatever happens next

    def clear_by_evidence(self, findings: list[Finding]) -> None:
        """A health check judges every GPU: what it saw may clear conditions (a reset, the check passing again)."""
        if self.ctx.kind != "healthcheck" or self.read_only or self.dry_run or not standing(self.journal.conditions):
            return
        from gpuguard.pipeline.undrain import clear_by_evidence, driver_seen  # a health check with a condition

        driver = driver_seen(self.store, self.ctx.node, read_driver_fingerprint(self.sources.sysfs_root),
                             self.read_only)
        cleared = clear_by_evidence(self.journal, self.store, findings, self.boot_id, self.cfg, driver, self.clock())
        if cleared:
            self.notes.append(f"cleared: {summary(cleared)}")

    def make_slurm_agree(self) -> None:
        """While a condition stands Slurm is made to agree (one read of this node); pending drains are retried."""
        j, now = self.journal, self.clock()
        if self.dry_run or not (standing(j.conditions) or j.pending):
            return
        if standing(j.conditions) and self.agreement["outcome"] == "none":
            self.agreement = agree(j, self.slurm, self.ctx.node, now)
            self.applied = list(self.agreement.get("applied") or [])
        if j.pending and self.agreement["outcome"] != "pending":  # reboot requests; drains from before conditions
            self.applied += retry_pending(j, self.slurm, self.ctx.node, self.cfg.reboot.auto, now=now)
        if not self.read_only:
            self._save_journal()

    def gather(self) -> tuple[list[CheckSpec], Observations, Any]:
        specs = plan_checks(self.cfg, self.ctx, self.profile, self.store, self.boot_id, now=self.clock())
        probes = build_probes(specs, self.cfg, self.ctx, self.sources, self.profile, self.kernel_position(),
                              self.store)
        obs = observations_from(gather(probes, self.budget.gather))
        name_processes(obs, self.sources.procfs_root)
        self.ctx, mapping = map_job_gpus(self.ctx, obs, self.cfg.slurm.gpu_ids)
        if self.ctx.kind == "epilog" and any(s.id == "gpu.leftovers" for s in specs) and not self.dry_run:
            from gpuguard.pipeline.cleanup import epilog_cleanup  # an epilog's: not on a prolog's path

            obs.cleanup = epilog_cleanup(self.ctx, self.cfg, obs, specs, self.sources, self.profile,
                                         self.budget.gather, self.log or _NullLog())
        obs.now = self.clock()
        obs.previous["pcie_replay"] = self.store.get_cursor(f"pcie_replay:{self.ctx.node}") or {}
        # the most this node was ever seen with (gpuguard.checks.inventory): a launch choice warns, a loss drains
        obs.previous["inventory"] = self.store.get_cursor(f"inventory:{self.ctx.node}") or {}
        return specs, obs, mapping

    def kernel_position(self) -> Optional[dict[str, Any]]:
        """Where the kernel log is judged from: the epilog from its job's start; otherwise the journal's position,
        or the store's copy when the journal has none (a new boot cleared /run, or an upgrade). With neither (both
        lost) this boot's whole log is judged again: a drain slurmctld already shows is not re-applied."""
        jc = job_cursor(self.ctx)
        if self.ctx.kind == "epilog" and jc:
            cursor = self.store.get_cursor(jc)
            if cursor:
                return cursor
        position = hook_position(self.journal, self.cfg, self.ctx.node) or \
            self.store.get_cursor(node_cursor(self.ctx.node))
        if position is None and (self.store.recreated_from or not self.store.available):
            self.notes.append("kernel-log position lost (history store "
                              + (f"damaged, moved to {self.store.recreated_from}" if self.store.recreated_from
                                 else "unusable") + ", no verdict journal): this boot's kernel log is judged again")
        return position

    @staticmethod
    def storm_exempt(verdict: Verdict) -> bool:
        """Unambiguous hardware evidence is never held back by the drain-storm guard."""
        return any(is_unambiguous(f) for f in verdict.failing if f.severity is Severity.FAIL)

    def storm_check(self, verdict: Verdict) -> None:
        """The drain-storm guard decides before anything is drained (gpuguard.pipeline.stormguard): a drain that would
        be part of a storm is held, never applied, and the storm is paged once. A health check lets go of a hold
        whose check passes again. An admin's own `gpuguard check` of a node is never held (it is no storm: someone
        asked for this node's verdict)."""
        guarded = verdict.outcome == "drain" and verdict.primary is not None and not self.kept \
            and not self.storm_exempt(verdict) and self.ctx.kind != "manual"
        if self.dry_run or not (guarded or self.ctx.kind == "healthcheck"):
            return
        from gpuguard.pipeline.stormguard import StormGuard  # cold path: a drain verdict, or a health check

        guard = StormGuard(self.cfg, self.slurm, self.ctx.node, self.clock,
                           lambda: min(STORM_SETTLE_S, self.budget.remaining() - 1.0))
        if self.ctx.kind == "healthcheck" and not self.read_only:
            guard.release({f.check_id for f in verdict.failing} if verdict.outcome == "drain" else set())
        hold = guard.decide(verdict) if guarded else None
        self.notes.extend(guard.notes)
        self.storm = guard if guarded and hold is None else None
        if hold is None:
            return
        verdict.outcome, verdict.held_by, verdict.reported_only = "warn", f"drain-storm guard: {hold.why}", True
        self.notes.append(verdict.held_by)
        self.events.extend(hold.events)

    def note_config(self) -> None:
        """A broken configuration is remembered in the journal (for `gpuguard status` and the metrics) and paged
        once when it breaks or changes, and resolved when it validates again."""
        before = self.journal.config or {}
        issues = [str(i) for i in self.cfg.issues]
        if before.get("issues") == (issues or None) or (not issues and not before):
            return  # unchanged: nothing to write, nothing to tell (the hook still logs it every run)
        from gpuguard.notify import Event  # cold path: the config broke or was fixed since the last run

        if issues:
            self.journal.config = {"mode": self.cfg.mode, "issues": issues, "source": self.cfg.source,
                                   "since": self.clock(), "last_good_at": self.cfg.last_good_at}
            self.events.append(Event(kind="internal_error", severity="critical", node=self.ctx.node,
                                     check_id="config", message=describe(self.cfg),
                                     action="fix the file (gpuguard config --check FILE names every bad key) "
                                            "and deploy it again; gpuguard keeps protecting the node meanwhile"))
        else:
            self.journal.config = {}
            self.events.append(Event(kind="internal_error", severity="info", node=self.ctx.node, check_id="config",
                                     state="resolved", message=f"configuration valid again ({self.cfg.source})"))
        if not self.read_only:
            self.store.set_cursor(f"config:{self.ctx.node}", self.journal.config)

    def commit(self, verdict: Verdict, obs: Observations) -> Optional[dict[str, Any]]:
        """Make the verdict durable together with the kernel-log position past its evidence (one journal write).
        Returns the position the store should copy (None: it must not move)."""
        kl = obs.kernel_log
        position = kl.cursor if (kl is not None and kl.cursor is not None and kl.status.complete
                                 and not self.read_only) else None
        if verdict.outcome == "drain" and verdict.reason and not self.dry_run:
            found = conditions_from_verdict(verdict, self.ctx.kind, self.clock(), self.boot_id,
                                            driver_fp=read_driver_fingerprint(self.sources.sysfs_root))
            if not self.read_only:
                self.journal.conditions, self.new_conditions = merge(self.journal.conditions, found)
            if not self.kept:
                self.pending = new_pending(verdict, self.ctx.kind, self.clock())
                if not self.read_only:
                    self.journal.add_pending(self.pending)
        if self.read_only:
            return None
        if position is not None and self.ctx.kind != "epilog":
            self.journal.positions["kernel_log"] = position
        if not self._save_journal():
            # No durable journal: the store's copy of the position moves only once the verdict was applied.
            return position if self.pending is None else None
        return position

    def act(self, result: RunResult) -> None:
        v = result.verdict
        if self.pending is not None:
            result.drain = apply_drain(v, self.pending, self.journal, self.slurm, self.ctx.node,
                                       self.cfg.reboot.auto, now=self.clock())
            if result.drain["outcome"] in ("done", "already", "foreign"):
                mark_applied(self.new_conditions)
            if self.storm is not None:  # the drain is in: this node's storm intent mark goes
                self.storm.after_drain()
            if not self.read_only:
                self._save_journal()
        elif v.outcome == "drain" and v.reason and self.dry_run:
            result.drain = {"outcome": "skipped", "detail": "dry run", "reason": v.reason}
        elif self.kept:
            result.drain = {"outcome": "kept", "reason": v.reason,
                            "detail": f"a condition of the node (Slurm: {self.agreement['outcome']}): "
                                      + summary(standing(self.journal.conditions))}
        result.pending = list(self.journal.pending)
        result.applied = self.applied
        result.events = self.events
        result.config_issues = [str(i) for i in self.cfg.issues]
        result.exit_code = self.exit_code(v)
        result.conditions = list(self.journal.conditions)
        result.agreement = {k: val for k, val in self.agreement.items() if k != "state"}
        result.refused = result.exit_code == 1 and v.outcome != "drain"
        if self.on_verdict is not None:
            self.on_verdict(result.exit_code)

    def record(self, result: RunResult, specs: list[CheckSpec], obs: Observations,
               position: Optional[dict[str, Any]]) -> None:
        result.duration_s = self.clock() - self.started
        result.run_id = record_run(self.store, result)
        record_drains(self.store, result)
        if not self.read_only:
            save_cursors(self.store, self.ctx, specs, obs, self.boot_id, position, profile=self.profile)
        if self.ctx.kind == "healthcheck" and not self.read_only and not self.dry_run and self.cfg.undrain.enabled \
                and (result.drain is None or result.drain["outcome"] == "kept"):
            result.undrain = self.undrain(result)
            result.conditions = list(self.journal.conditions)
        if self.journal.error:
            result.notes.append(self.journal.error)
        if not self.dry_run:
            tell_humans(self.cfg, result, self.budget, defer=self.hook)
        if self.ctx.kind == "healthcheck" and not self.read_only:
            self._ship(result)
        if self.store.errors:
            # The verdict and the exit code above stand whatever the store did; the journal keeps the position.
            result.store_errors = list(self.store.errors)
            result.notes.append("history store unusable, verdict from the hardware alone, nothing recorded: "
                                + "; ".join(self.store.errors)[:400])

    def undrain(self, result: RunResult) -> Optional[dict[str, Any]]:
        """gpuguard's drain lifted once every condition has cleared (gpuguard.pipeline.undrain)."""
        if not self.journal.conditions:
            return None
        from gpuguard.pipeline.undrain import lift_conditions  # a health check with a condition

        out = lift_conditions(self.journal, self.store, self.slurm, self.ctx.node, result, self.cfg,
                              self.agreement.get("state"), self.clock())
        self._save_journal()
        return out

    def _ship(self, result: RunResult) -> None:
        from gpuguard.store.retention import RETENTION_CURSOR, prune_due  # a health check's: not a prolog's

        scfg = self.cfg.store
        prune = bool(scfg.retention_days) and prune_due(self.store.get_cursor(RETENTION_CURSOR), self.clock())
        if not scfg.url and not prune:
            return  # nothing to ship or prune (gpuguard.fleet.ship.ship_after_run's own test, without the import)
        try:  # central history + retention, bounded by store.ship_budget_s; never on a prolog's path
            from gpuguard.fleet.ship import ship_after_run  # cold path: only where store.url is set or pruning is due

            ship_after_run(self.cfg, result, self.budget.total, prune=prune)
        except Exception as e:  # noqa: BLE001 - shipping history must never change what the run decided
            result.notes.append(f"central history: {type(e).__name__}: {e}"[:300])

    def _save_journal(self) -> bool:
        return self.journal.save() is None


class _NullLog:
    def log(self, level: str, msg: str) -> None:
        pass
