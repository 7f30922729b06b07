"""The slurmd entry points (`gpuguard prolog | epilog | healthcheck`): load the config the way a fleet can rely on
(gpuguard.config.lastgood), run the pipeline under a watchdog that exits with the verdict whatever hangs after it,
log what happened. Nothing here is imported by any other command.

This is the prolog's hot path (it runs before every job): the hook scripts run gpuguard.agent.client, which has the
node agent (gpuguard.agent) run `run_hook` in a pre-imported child, or calls `main` here. It parses its two options by
hand (no argparse) and imports only what a hook run needs; what only a failing run needs (notifications, a traceback)
is imported where it is used. tests/unit/test_agent_wire.py keeps it that way.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from gpuguard.config.lastgood import describe
from gpuguard.siteconfig import load_guarded
from gpuguard.context import context_from_env
from gpuguard.model import Handoff
from gpuguard.pipeline.run import execute
from gpuguard.simulate.sources import resolve_sources
from gpuguard.slurm.client import client_from_config, drain_node
from gpuguard.slurm.reason import format_reason
from gpuguard.store import replaced
from gpuguard.store.sqlite import Store
from gpuguard.util.log import HookLog
from gpuguard.util.record import replace
from gpuguard.util.timefmt import iso_utc

HOOK_KINDS = ("prolog", "epilog", "healthcheck")
USAGE = "usage: gpuguard {prolog|epilog|healthcheck} [--config FILE] [--simulate SCENARIO]"


class HookUsageError(ValueError):
    pass


def parse_hook_args(argv: Sequence[str]) -> tuple[str, Optional[str], Optional[str]]:
    """`KIND [--config FILE] [--simulate SCENARIO]` (also `--opt=value`) -> (kind, config, simulate). slurmd passes
    no arguments at all; the options are for admins and tests."""
    if not argv or argv[0] not in HOOK_KINDS:
        raise HookUsageError(f"the first argument must be one of {', '.join(HOOK_KINDS)}")
    opts: dict[str, Optional[str]] = {"--config": None, "--simulate": None}
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if name not in opts:
            raise HookUsageError(f"unrecognized argument: {arg}")
        if not eq:
            if not rest:
                raise HookUsageError(f"{name} needs a value")
            value = rest.pop(0)
        opts[name] = value
    return argv[0], opts["--config"], opts["--simulate"]


def main(argv: Optional[Sequence[str]] = None, started: Optional[float] = None, via: Optional[str] = None) -> int:
    """Run a hook in this process and exit with its verdict (what gpuguard.agent.client falls back to; also
    `python -I -m gpuguard.cli.hooks KIND`). `started`: when the hook process started (time.monotonic()); `via`:
    why an agent did not run it, for the result line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help") or args[1:2] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        kind, config, simulate = parse_hook_args(args)
    except HookUsageError as e:
        print(f"{USAGE}\ngpuguard: error: {e}", file=sys.stderr)
        return 2
    code = run_hook(kind, config, simulate, started=started, via=via)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never wait for a probe thread stuck in the driver


def _watchdog(seconds: float, state: dict[str, Any], log: Any, exit_process: Callable[[int], Any] = os._exit) -> Any:
    """Last line of defence: whatever hangs, the hook exits before slurmd's own timeout."""

    def fire() -> None:
        log.error(f"{state['kind']}: {state.get('phase', 'total')} deadline of {seconds:g}s exceeded; "
                  f"exiting with {state['exit_code']}")
        exit_process(state["exit_code"])

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


# The least a run gets to judge the hardware, even when it starts late: the node agent's child was lost near the
# deadline and the hook runs again in its own process (gpuguard.agent.client), or the config sat on a hung filesystem.
# The stages share what is left of the hook's deadline, so a probe that does not answer within its share counts as
# timed out (a hung NVML drains, gpu.nvml TIMEOUT) before the watchdog could end the run with no verdict (exit 0 under
# the open policy). Such a hook ends at most this much past its deadline; slurmd's PrologEpilogTimeout (60 s, `gpuguard
# slurm-conf`) is far above it.
MIN_RUN_S = 3.0

# A config on a hung filesystem (NFS) must not hang the hook until slurmd kills it: after this long the hook runs
# with the last good configuration (gpuguard.config.lastgood).
CONFIG_LOAD_TIMEOUT_S = 10.0


def _config_read_timeout() -> float:
    try:  # tests shorten it; slurmd gives hooks a bare environment, so on a node it is the constant
        return float(os.environ.get("GPUGUARD_CONFIG_LOAD_TIMEOUT_S", CONFIG_LOAD_TIMEOUT_S))
    except ValueError:
        return CONFIG_LOAD_TIMEOUT_S


def run_hook(kind: str, config_path: Optional[str], simulate: Optional[str] = None, *,
             started: Optional[float] = None, report: Optional[Callable[[int, float, bool], None]] = None,
             exit_process: Callable[[int], Any] = os._exit, via: Optional[str] = None) -> int:
    """Run one hook; returns its exit code. `started`: when the hook process started (time.monotonic(); the
    deadline counts from there). `report(code, ends_s, final)`: told the exit code the hook would end with if it
    were stopped now, whenever that changes, when the run ends at the latest (seconds from `started`) and whether
    the code is the verdict (the node agent's client, gpuguard.agent). `exit_process`: how the watchdog
    ends the process. `via`: who runs it, for the log line (`agent`). The caller exits right after: the
    notifications the run spooled are delivered by a process of their own (gpuguard.notify.handoff)."""
    ctx = context_from_env(kind, os.environ)
    if via:
        ctx = replace(ctx, via=via)  # counted in the metrics (gpuguard_hook_runs_via_total)
    if os.geteuid() != 0 and simulate is None:
        return _not_root(kind, ctx.node)
    handoff = Handoff()
    code = _run(kind, ctx, config_path, simulate, started, report, exit_process, via, handoff)
    if handoff.wanted:
        from gpuguard.notify.handoff import hand_off  # cold path: this run has something to tell

        hand_off(config_path, ctx.node)
    return code


NOT_ROOT_EXIT = 2


def _not_root(kind: str, node: str) -> int:
    """A hook run by a user checks nothing (it can read neither the GPUs' state nor root's store, nor drain):
    say so on stderr and in syslog, whatever the hook, and fail."""
    uid = os.geteuid()
    msg = (f"gpuguard {kind} on {node}: must run as root (slurmd runs its hooks as root); running as uid {uid}: "
           f"nothing was checked, exit {NOT_ROOT_EXIT}")
    print(msg, file=sys.stderr)
    HookLog(True, None, "error", stderr=False).error(msg)
    return NOT_ROOT_EXIT


def _run(kind: str, ctx: Any, config_path: Optional[str], simulate: Optional[str], started: Optional[float],
         report: Optional[Callable[[int, float, bool], None]], exit_process: Callable[[int], Any],
         via: Optional[str], handoff: Handoff) -> int:
    t0 = time.monotonic() if started is None else started
    cfg = load_guarded(config_path, read_timeout_s=_config_read_timeout())  # never raises: last good, loudly
    lg = cfg.logging
    log = HookLog(lg.syslog, lg.file, lg.level, stderr=kind != "healthcheck")
    if cfg.issues:
        log.error(f"{kind} on {ctx.node}: {describe(cfg)}")
    if ctx.ignored_env:
        log.warning(f"{kind} on {ctx.node}: ignored malformed environment variables: {', '.join(ctx.ignored_env)}")
    open_policy = cfg.policy.on_internal_error == "open"
    # the run's deadline counts from the hook's start, config loading (and a lost agent child's time) included
    elapsed = time.monotonic() - t0
    budget_s = max(MIN_RUN_S, cfg.deadlines.for_kind(kind) - elapsed)
    state: dict[str, Any] = {"kind": kind, "exit_code": 0 if open_policy else 1}

    def set_exit_code(code: int) -> None:
        state["exit_code"] = code
        if report is not None:
            report(code, elapsed + budget_s, bool(state.get("verdict")))

    set_exit_code(state["exit_code"])
    _watchdog(budget_s + 1.0, state, log, exit_process)
    try:
        def verdict_known(code: int) -> None:
            # from here on the hardware has spoken: a hang in drain/notify/store must not turn it into exit 0
            state["verdict"] = True
            set_exit_code(code)

        result = execute(ctx, cfg, resolve_sources(cfg, ctx.node, simulate), deadline_s=budget_s,
                         on_verdict=verdict_known, log=log, hook=True)
    except Exception as e:  # noqa: BLE001 - the policy decides, never a traceback
        return _internal_error(cfg, ctx, kind, e, log, open_policy, state, handoff)
    _log_result(kind, ctx, result, log, via)
    handoff.wanted = handoff.wanted or bool(getattr(result, "handoff", False))
    if getattr(result, "store_errors", None):
        _tell_store_trouble(cfg, ctx, kind, result.store_errors, handoff)
    if kind == "healthcheck" or replaced.replaced_here():
        _tell_store_replaced(cfg, ctx, kind, log, handoff)
    set_exit_code(result.exit_code)
    return result.exit_code


def _log_result(kind: str, ctx: Any, result: Any, log: Any, via: Optional[str] = None) -> None:
    v = result.verdict
    outcome = "refused" if getattr(result, "refused", False) else v.outcome
    msg = (f"{kind} node={ctx.node} job={ctx.job_id} verdict={outcome} took={result.duration_s:.3f}s"
           + (f" via={via}" if via else "")
           + (f" reason={v.reason!r} drain={result.drain['outcome'] if result.drain else 'n/a'}" if v.reason else ""))
    bad = [f"{f.check_id}:{f.severity.value}:{f.message}" for f in result.findings
           if f.severity.value in ("fail", "warn", "incomplete")]
    standing = [c for c in getattr(result, "conditions", []) if c.standing]
    if standing:
        msg += f" conditions={_conditions_text(standing)!r} slurm={(result.agreement or {}).get('outcome', '-')}"
    log.log("error" if v.outcome == "drain" or outcome == "refused" else ("warning" if v.outcome == "warn" else "info"),
            msg + (" findings=" + " ; ".join(bad) if bad else ""))
    agreement = result.agreement or {}
    if agreement.get("outcome") in ("redrained", "replaced"):
        log.error(f"{kind} on {ctx.node}: {agreement.get('detail')}: {agreement.get('reason')}")
    for a in result.applied:
        log.error(f"{kind} on {ctx.node}: pending {a['pending'].op} applied ({a['outcome']}) after "
                  f"{a['pending'].attempts + 1} attempt(s): {a['pending'].reason}")
    for p in result.pending:
        log.error(f"{kind} on {ctx.node}: {p.op} PENDING since {_iso(p.created)} ({p.attempts} attempt(s), last "
                  f"error: {p.last_error}); jobs are refused until Slurm takes it: {p.reason}")
    u = result.undrain or {}
    if u.get("outcome") in ("done", "gone", "flapping", "failed"):
        log.log("warning" if u["outcome"] != "done" else "info",
                f"{kind} on {ctx.node}: undrain {u['outcome']} ({u.get('check_id') or '-'}): {u.get('detail', '')}")
    if result.notes:
        log.warning(f"{kind} on {ctx.node}: " + " | ".join(result.notes))


def _conditions_text(conds: list[Any]) -> str:
    return "; ".join(f"{c.keyword} {c.check_id} {c.action} since {_iso(c.first_seen)}" for c in conds)[:300]


def _iso(ts: float) -> str:
    return iso_utc(ts) or "?"


def _internal_error(cfg: Any, ctx: Any, kind: str, e: Exception, log: Any, open_policy: bool,
                    state: dict[str, Any], handoff: Handoff) -> int:
    """A gpuguard bug: logged with its traceback, recorded, told; the exit code is the verdict if one was already
    reached (the hardware had spoken), else the on_internal_error policy's."""
    import traceback  # cold path: only a gpuguard bug gets here

    log.error(f"{kind} on {ctx.node} job {ctx.job_id}: INTERNAL ERROR {type(e).__name__}: {e} | "
              + traceback.format_exc(limit=6).replace("\n", " | "))
    if state.get("verdict"):  # the hardware has spoken already: its verdict stands
        log.error(f"{kind} on {ctx.node}: the verdict was reached before the error: exiting with it "
                  f"({state['exit_code']})")
    _record_internal_error(cfg, ctx, f"{type(e).__name__}: {e}", state["exit_code"])
    try:
        from gpuguard.notify import Event, emit  # cold path: only a crashed run notifies from here

        emit(cfg, Event(kind="internal_error", node=ctx.node, severity="critical", job_id=ctx.job_id,
                        message=f"gpuguard {kind} crashed ({type(e).__name__}: {e}); "
                                + ("node NOT drained (policy open)" if open_policy else "draining (policy closed)"),
                        action="see the gpuguard log on the node; report the bug"), budget_s=2.0, defer=handoff)
    except Exception:  # noqa: BLE001
        pass
    if state.get("verdict"):
        return int(state["exit_code"])
    if open_policy:
        return 0
    _drain_internal(cfg, ctx, kind, f"{type(e).__name__}: {e}", log)
    return 1 if kind != "healthcheck" else 0


def _tell_store_trouble(cfg: Any, ctx: Any, kind: str, errors: list[str], handoff: Handoff) -> None:
    """The history store failed (disk full, read-only, locked): the run still judged the hardware, but its
    memory (cursors, drain records, undrain counters) is not being kept. A human should know."""
    try:
        from gpuguard.notify import Event, emit  # cold path: only an unusable store notifies from here

        emit(cfg, Event(kind="internal_error", node=ctx.node, severity="critical", job_id=ctx.job_id,
                        check_id="store", message=f"gpuguard {kind}: history store unusable: {errors[0][:300]}",
                        action="free space / fix permissions on the store's filesystem "
                               "(store.path); the verdict was still applied"), budget_s=1.0, defer=handoff)
    except Exception:  # noqa: BLE001 - the log line is the primary record
        pass


def _tell_store_replaced(cfg: Any, ctx: Any, kind: str, log: Any, handoff: Handoff) -> None:
    """A store found damaged and replaced (gpuguard.store.replaced): logged at error level and paged once, at once
    when this process replaced it, else by the next health check (the watch daemon, the notification hand-off or
    an admin command may have). Never raises."""
    paths = replaced.replaced_here()
    if kind == "healthcheck":
        paths += [cfg.store.path_for(ctx.node)]
        if cfg.notify.state_path:  # the notification state in a file of its own
            paths.append(str(cfg.notify.state_path).replace("{node}", ctx.node))
    for path in dict.fromkeys(paths):
        try:
            if not os.path.exists(path):
                continue
            with Store(path, timeout_s=1.0) as st:
                note = replaced.untold(st)
                if note is None:
                    continue
                what = replaced.describe(path, note)
                log.error(f"{kind} on {ctx.node}: {what}")
                from gpuguard.notify import Event, emit  # cold path: only a replaced store pages from here

                key = f"gpuguard/{ctx.node}/store-replaced/{os.path.basename(note['aside'])}"  # one per replacement
                sent = emit(cfg, Event(kind="internal_error", node=ctx.node, severity="critical",
                                       check_id="store.replaced", message=what, dedup_key=key,
                                       action="nothing is lost for the hardware (the verdict journal keeps the "
                                              "kernel-log position); keep the damaged copy for a bug report and "
                                              "check the disk (dmesg, smartctl)"), budget_s=1.0, defer=handoff)
                if sent != "failed":  # a page that could not go out is tried again by the next health check
                    replaced.mark_told(st, note)
        except Exception:  # noqa: BLE001 - the store's own syslog line is the primary record
            pass


def _record_internal_error(cfg: Any, ctx: Any, error: str, exit_code: int) -> None:
    """Best effort: `gpuguard history` should show that a run crashed, not just that it is missing."""
    try:
        with Store(cfg.store.path_for(ctx.node), timeout_s=1.0) as st:
            st.record_run(started=time.time(), duration_ms=None, node=ctx.node, kind=ctx.kind, job_id=ctx.job_id,
                          profile=None, verdict="error", action=None, reason=None, exit_code=exit_code,
                          error=error[:500], boot_id=None, findings=[])
    except Exception:  # noqa: BLE001 - the log line above is the primary record
        pass


def _drain_internal(cfg: Any, ctx: Any, kind: str, detail: str, log: Any) -> None:
    try:
        client = client_from_config(cfg.slurm, cfg.deadlines.scontrol_s)
        out = drain_node(client, ctx.node, format_reason("gpuguard", "INTERNAL", detail, kind))
        log.error(f"{kind} on {ctx.node}: drained for internal error (policy closed): {out.outcome} {out.detail}")
    except Exception as e:  # noqa: BLE001
        log.error(f"{kind} on {ctx.node}: could not drain for internal error: {e}")


if __name__ == "__main__":
    raise SystemExit(main())
