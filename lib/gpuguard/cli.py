"""`gpuguard` command line. Imports are lazy: the prolog runs before every job."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

HOOK_KINDS = ("prolog", "epilog", "healthcheck")

# Subcommands contributed by feature modules, imported only when the full parser is built (never on the
# hooks' hot path). Each module exposes `add_parser(subparsers) -> None` and `run(args) -> int`.
FEATURE_COMMANDS: dict[str, str] = {
    # @command:watch
    "watch": "gpuguard.watch",
    # @command:templates
    "render": "gpuguard.templates.cli",
    "templates": "gpuguard.templates.cli",
    "lint": "gpuguard.templates.cli",
    "job-attempt": "gpuguard.templates.cli",
    # @command:nccl
    "nccl": "gpuguard.nccl.cli",
    "efa": "gpuguard.nccl.cli",
    "dcgm": "gpuguard.nccl.cli",
    "baseline": "gpuguard.nccl.cli",
    # @command:monitor
    "monitor": "gpuguard.monitor.cli",
    "trainlog": "gpuguard.monitor.cli",
    "status": "gpuguard.monitor.cli",
    "history": "gpuguard.monitor.cli",
    # @command:fleet
    "fleet": "gpuguard.fleet.cli",
}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config file (default $GPUGUARD_CONFIG or /etc/gpuguard/config.yaml)")


def build_parser(only_feature: Optional[str] = None) -> argparse.ArgumentParser:
    """The full parser. `only_feature`: import just that feature module (the command being run), so a
    broken or missing optional module cannot take every other command down with it."""
    from gpuguard import __version__

    ap = argparse.ArgumentParser(prog="gpuguard", description="Keep GPU training clusters healthy under Slurm.")
    ap.add_argument("-V", "--version", action="version", version=f"gpuguard {__version__}")
    _add_common(ap)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    for kind, helptext in (("prolog", "slurmd Prolog= entry point: pre-flight the job's GPUs, drain on failure"),
                           ("epilog", "slurmd Epilog= entry point: check the node after the job"),
                           ("healthcheck", "slurmd HealthCheckProgram= entry point: scan all GPUs")):
        p = sub.add_parser(kind, help=helptext)
        _add_common(p)
        p.add_argument("--simulate", metavar="SCENARIO", help="run against a simulated node")

    p = sub.add_parser("check", help="run the checks by hand and print a report")
    _add_common(p)
    p.add_argument("--context", default="manual", choices=("manual", "prolog", "epilog", "healthcheck"),
                   help="which run kind's checks to run (default manual: all of them)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--dry-run", action="store_true", help="never drain, never advance the kernel-log cursor")
    p.add_argument("--simulate", metavar="SCENARIO", help="a scenario file: check a simulated node")
    p.add_argument("--node", help="node name (default: this host / $SLURMD_NODENAME)")
    p.add_argument("--gpus", help="only these GPU indices, e.g. 0,1 or 0-3 (default: all)")
    p.add_argument("-v", "--verbose", action="store_true", help="also show skipped checks")

    p = sub.add_parser("xid", help="Xid tools")
    xs = p.add_subparsers(dest="xid_cmd", metavar="SUBCOMMAND")
    from gpuguard.kernellog import scanargs

    scanargs.add_arguments(xs.add_parser("scan", help=scanargs.HELP))
    e = xs.add_parser("explain", help="what an Xid code means and what gpuguard does about it")
    _add_common(e)
    e.add_argument("code", type=int)

    p = sub.add_parser("slurm-conf", help="print the slurm.conf lines gpuguard needs, with why")
    p.add_argument("--prefix", default="/usr/local", help="where gpuguard is installed (default /usr/local)")

    p = sub.add_parser("profiles", help="list instance profiles, or show one")
    _add_common(p)
    p.add_argument("name", nargs="?")

    p = sub.add_parser("config", help="validate a config file and print the effective settings")
    _add_common(p)
    p.add_argument("--check", metavar="FILE", help="validate FILE before deploying it: every bad key with its line; "
                   "exit 1 when there is any")

    p = sub.add_parser("undrain", help="lift a drain gpuguard put on a node (admin)")
    _add_common(p)
    p.add_argument("node")
    p.add_argument("--force", action="store_true",
                   help="also lift a drain gpuguard did not set, or a FLAPPING / down / maintenance node")

    p = sub.add_parser("simulate", help="simulation helpers")
    ss = p.add_subparsers(dest="sim_cmd", metavar="SUBCOMMAND")
    b = ss.add_parser("build", help="compile the fake libnvidia-ml.so.1")
    b.add_argument("--out", help="output directory")
    i = ss.add_parser("inject", help="change a scenario as hardware would under a running job")
    i.add_argument("scenario", help="scenario file to change in place")
    i.add_argument("--kernel-line", action="append", default=[], help="append a kernel log line (repeatable)")
    i.add_argument("--process", action="append", default=[], metavar="GPU:PID",
                   help="a live process on a GPU (listed while the pid runs)")
    i.add_argument("--set", metavar="GPU:KEY=VALUE", help="set one GPU field, e.g. 3:ecc_volatile_uncorrected=2")

    import importlib

    modules = [only_feature] if only_feature else list(dict.fromkeys(FEATURE_COMMANDS.values()))
    for module in modules:
        if only_feature:
            importlib.import_module(module).add_parser(sub)
            continue
        try:  # the full parser (help, unknown command): one broken optional module must not hide the rest
            importlib.import_module(module).add_parser(sub)
        except Exception as e:  # noqa: BLE001
            print(f"gpuguard: warning: commands of {module} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return ap


def build_hook_parser(kind: str) -> argparse.ArgumentParser:
    """The hooks' own tiny parser: slurmd passes no arguments, the hot path imports nothing else."""
    p = argparse.ArgumentParser(prog=f"gpuguard {kind}")
    p.add_argument("kind", choices=HOOK_KINDS)
    _add_common(p)
    p.add_argument("--simulate", metavar="SCENARIO", help="run against a simulated node")
    return p


# --------------------------------------------------------------------------- hooks (prolog/epilog/healthcheck)


def _watchdog(seconds: float, state: dict[str, Any], log: Any) -> Any:
    """Last line of defence: whatever hangs, the hook exits before slurmd's own timeout."""
    import threading

    def fire() -> None:
        log.error(f"{state['kind']}: {state.get('phase', 'total')} deadline of {seconds:g}s exceeded; "
                  f"exiting with {state['exit_code']}")
        os._exit(state["exit_code"])

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


# A config on a hung filesystem (NFS) must not hang the hook until slurmd kills it: after this long the hook runs
# with the last good configuration (gpuguard.lastgood).
CONFIG_LOAD_TIMEOUT_S = 10.0


def _config_read_timeout() -> float:
    try:  # tests shorten it; slurmd gives hooks a bare environment, so on a node it is the constant
        return float(os.environ.get("GPUGUARD_CONFIG_LOAD_TIMEOUT_S", CONFIG_LOAD_TIMEOUT_S))
    except ValueError:
        return CONFIG_LOAD_TIMEOUT_S


def run_hook(kind: str, config_path: Optional[str], simulate: Optional[str] = None) -> int:
    import time

    from gpuguard.context import context_from_env
    from gpuguard.lastgood import describe, load_guarded
    from gpuguard.log import HookLog

    t0 = time.monotonic()
    ctx = context_from_env(kind, os.environ)
    cfg = load_guarded(config_path, read_timeout_s=_config_read_timeout())  # never raises: last good, loudly
    lg = cfg.sections["logging"]
    log = HookLog(lg["syslog"], lg["file"], lg["level"], stderr=kind != "healthcheck")
    if cfg.issues:
        log.error(f"{kind} on {ctx.node}: {describe(cfg)}")
    if ctx.ignored_env:
        log.warning(f"{kind} on {ctx.node}: ignored malformed environment variables: {', '.join(ctx.ignored_env)}")
    open_policy = cfg.sections["policy"]["on_internal_error"] == "open"
    deadline = cfg.sections["deadlines"][f"{kind}_s"]
    state: dict[str, Any] = {"kind": kind, "exit_code": 0 if open_policy else 1}
    # the run's deadline counts from the hook's start, config loading included
    _watchdog(max(0.5, deadline + 1.0 - (time.monotonic() - t0)), state, log)
    try:
        from gpuguard.pipeline.run import execute
        from gpuguard.simulate.sources import resolve_sources

        def verdict_known(code: int) -> None:
            # from here on the hardware has spoken: a hang in drain/notify/store must not turn it into exit 0
            state["exit_code"], state["verdict"] = code, True

        result = execute(ctx, cfg, resolve_sources(cfg, ctx.node, simulate), deadline_s=deadline,
                         on_verdict=verdict_known, log=log, hook=True)
    except Exception as e:  # noqa: BLE001 - the policy decides, never a traceback
        return _internal_error(cfg, ctx, kind, e, log, open_policy, state)
    _log_result(kind, ctx, result, log)
    if getattr(result, "store_errors", None):
        _tell_store_trouble(cfg, ctx, kind, result.store_errors)
    state["exit_code"] = result.exit_code
    return result.exit_code


def _log_result(kind: str, ctx: Any, result: Any, log: Any) -> None:
    v = result.verdict
    msg = (f"{kind} node={ctx.node} job={ctx.job_id} verdict={v.outcome} took={result.duration_s:.3f}s"
           + (f" reason={v.reason!r} drain={result.drain['outcome'] if result.drain else 'n/a'}" if v.reason else ""))
    bad = [f"{f.check_id}:{f.severity.value}:{f.message}" for f in result.findings
           if f.severity.value in ("fail", "warn", "incomplete")]
    log.log("error" if v.outcome == "drain" else ("warning" if v.outcome == "warn" else "info"),
            msg + (" findings=" + " ; ".join(bad) if bad else ""))
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


def _iso(ts: float) -> str:
    from gpuguard.timefmt import iso_utc

    return iso_utc(ts) or "?"


def _internal_error(cfg: Any, ctx: Any, kind: str, e: Exception, log: Any, open_policy: bool,
                    state: dict[str, Any]) -> int:
    """A gpuguard bug: logged with its traceback, recorded, told; the exit code is the verdict if one was already
    reached (the hardware had spoken), else the on_internal_error policy's."""
    import traceback

    log.error(f"{kind} on {ctx.node} job {ctx.job_id}: INTERNAL ERROR {type(e).__name__}: {e} | "
              + traceback.format_exc(limit=6).replace("\n", " | "))
    if state.get("verdict"):  # the hardware has spoken already: its verdict stands
        log.error(f"{kind} on {ctx.node}: the verdict was reached before the error: exiting with it "
                  f"({state['exit_code']})")
    _record_internal_error(cfg, ctx, f"{type(e).__name__}: {e}", state["exit_code"])
    try:
        from gpuguard.notify import Event, emit

        emit(cfg, Event(kind="internal_error", node=ctx.node, severity="critical", job_id=ctx.job_id,
                        message=f"gpuguard {kind} crashed ({type(e).__name__}: {e}); "
                                + ("node NOT drained (policy open)" if open_policy else "draining (policy closed)"),
                        action="see the gpuguard log on the node; report the bug"), budget_s=2.0)
    except Exception:  # noqa: BLE001
        pass
    if state.get("verdict"):
        return int(state["exit_code"])
    if open_policy:
        return 0
    _drain_internal(cfg, ctx, kind, f"{type(e).__name__}: {e}", log)
    return 1 if kind != "healthcheck" else 0


def _tell_store_trouble(cfg: Any, ctx: Any, kind: str, errors: list[str]) -> None:
    """The history store failed (disk full, read-only, locked): the run still judged the hardware, but its
    memory (cursors, drain records, undrain counters) is not being kept. A human should know."""
    try:
        from gpuguard.notify import Event, emit

        emit(cfg, Event(kind="internal_error", node=ctx.node, severity="critical", job_id=ctx.job_id,
                        check_id="store", message=f"gpuguard {kind}: history store unusable: {errors[0][:300]}",
                        action="free space / fix permissions on the store's filesystem "
                               "(store.path); the verdict was still applied"), budget_s=1.0)
    except Exception:  # noqa: BLE001 - the log line is the primary record
        pass


def _record_internal_error(cfg: Any, ctx: Any, error: str, exit_code: int) -> None:
    """Best effort: `gpuguard history` should show that a run crashed, not just that it is missing."""
    import time

    try:
        from gpuguard.store import Store

        with Store(cfg.sections["store"]["path"].replace("{node}", ctx.node), timeout_s=1.0) as st:
            st.record_run(started=time.time(), duration_ms=None, node=ctx.node, kind=ctx.kind, job_id=ctx.job_id,
                          profile=None, verdict="error", action=None, reason=None, exit_code=exit_code,
                          error=error[:500], boot_id=None, findings=[])
    except Exception:  # noqa: BLE001 - the log line above is the primary record
        pass


def _drain_internal(cfg: Any, ctx: Any, kind: str, detail: str, log: Any) -> None:
    from gpuguard.reason import format_reason
    from gpuguard.slurm import client_from_config, drain_node

    try:
        client = client_from_config(cfg.sections["slurm"], cfg.sections["deadlines"]["scontrol_s"])
        out = drain_node(client, ctx.node, format_reason("gpuguard", "INTERNAL", detail, kind))
        log.error(f"{kind} on {ctx.node}: drained for internal error (policy closed): {out.outcome} {out.detail}")
    except Exception as e:  # noqa: BLE001
        log.error(f"{kind} on {ctx.node}: could not drain for internal error: {e}")


# --------------------------------------------------------------------------- commands


def cmd_check(args: argparse.Namespace) -> int:
    from gpuguard.config import load_config
    from gpuguard.context import RunContext, context_from_env, parse_gpu_list
    from gpuguard.pipeline.run import execute
    from gpuguard.report import print_report
    from gpuguard.simulate.sources import resolve_sources

    cfg = load_config(args.config)
    base = context_from_env(args.context if args.context != "manual" else "manual", os.environ, node=args.node
                            or cfg.sections["node"]["name"])
    gpus = parse_gpu_list(args.gpus) if args.gpus else (base.gpu_indices if args.context in ("prolog", "epilog")
                                                        else None)
    ctx = RunContext(kind=args.context, node=base.node, job_id=base.job_id, job_user=base.job_user,
                     gpu_indices=gpus, restart_count=base.restart_count, exclusive=base.exclusive)
    result = execute(ctx, cfg, resolve_sources(cfg, ctx.node, args.simulate), dry_run=args.dry_run)
    print_report(result, args.json, verbose=args.verbose)
    return result.exit_code


def cmd_xid(args: argparse.Namespace) -> int:
    if args.xid_cmd == "explain":
        from gpuguard.config import load_config
        from gpuguard.xid import load_catalog

        overrides = load_config(args.config).sections["xid"]["overrides"] if args.config else None
        print(load_catalog(overrides=overrides or None).explain(args.code))
        return 0
    if args.xid_cmd == "scan":
        from gpuguard.kernellog import scancli

        return scancli.run(args)
    print("usage: gpuguard xid {scan,explain} ...", file=sys.stderr)
    return 2


def cmd_profiles(args: argparse.Namespace) -> int:
    import dataclasses

    from gpuguard.config import load_config
    from gpuguard.profiles import list_profiles, load_profile

    extra = load_config(args.config).sections["node"]["profile_dir"] if args.config else None
    if args.name:
        prof = load_profile(args.name, extra)
        for k, v in dataclasses.asdict(prof).items():
            if v not in (None, {}, ()):
                print(f"{k:<26} {v}")
        return 0
    for name, path in list_profiles(extra).items():
        prof = load_profile(name, extra)
        print(f"{name:<20} {prof.description}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import json

    from gpuguard.config import load_config

    if args.check:
        from gpuguard.lastgood import check_file

        issues = check_file(args.check)
        for issue in issues:
            print(f"{args.check}: {issue}")
        print(f"{args.check}: {'INVALID: ' + str(len(issues)) + ' problem(s)' if issues else 'valid'}")
        return 1 if issues else 0

    cfg = load_config(args.config)
    print(f"# {cfg.source}: valid (secrets redacted)")
    print(json.dumps({"sections": redact_config(cfg.sections), "checks": cfg.checks}, indent=2, default=str))
    return 0


def redact_config(sections: dict[str, Any]) -> dict[str, Any]:
    """The effective settings without their secrets (gpuguard.redact)."""
    from gpuguard.redact import redact_config as redact

    return redact(sections)


def cmd_undrain(args: argparse.Namespace) -> int:
    """The admin's undrain (gpuguard.pipeline.admin): ownership rules and a re-check unless --force."""
    from gpuguard.config import load_config
    from gpuguard.log import HookLog
    from gpuguard.pipeline.admin import admin_undrain

    cfg = load_config(args.config)
    lg = cfg.sections["logging"]
    out = admin_undrain(cfg, args.node, args.force, HookLog(lg["syslog"], lg["file"], lg["level"], stderr=False))
    print(out.message if out.code == 0 else f"gpuguard: {out.message}", file=sys.stdout if out.code == 0 else sys.stderr)
    return out.code


def cmd_slurm_conf(args: argparse.Namespace) -> int:
    from gpuguard.slurmconf import recommended_lines

    print(recommended_lines(args.prefix))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.sim_cmd == "build":
        from pathlib import Path

        from gpuguard.simulate.build import build_fake_nvml

        print(build_fake_nvml(Path(args.out) if args.out else None))
        return 0
    if args.sim_cmd == "inject":
        import yaml

        from gpuguard.simulate.scenario import inject

        procs = []
        for item in args.process:
            gpu, _, pid = item.partition(":")
            procs.append((int(gpu), int(pid)))
        set_gpu = None
        if args.set:
            gpu, _, kv = args.set.partition(":")
            key, _, value = kv.partition("=")
            set_gpu = (int(gpu), key, yaml.safe_load(value))
        inject(args.scenario, kernel_lines=args.kernel_line, processes=procs, set_gpu=set_gpu)
        return 0
    print("usage: gpuguard simulate {build,inject} ...", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["--version"], ["-V"]):  # without importing every feature module
        from gpuguard import __version__

        print(f"gpuguard {__version__}")
        return 0
    # Fast path for the hooks: no argparse help machinery needed beyond a tiny parse.
    if argv and argv[0] in HOOK_KINDS:
        args = build_hook_parser(argv[0]).parse_args(argv)
        code = run_hook(argv[0], args.config, args.simulate)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never wait for a probe thread stuck in the driver
    if argv[:2] == ["xid", "scan"]:  # lean path: a 1 GiB log scans in grep's time only without the full CLI
        from gpuguard.kernellog import scancli

        return scancli.main(argv[2:])
    cmd = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(FEATURE_COMMANDS.get(cmd or "")).parse_args(argv)
    handlers = {"check": cmd_check, "xid": cmd_xid, "profiles": cmd_profiles, "config": cmd_config,
                "slurm-conf": cmd_slurm_conf, "simulate": cmd_simulate,
                "undrain": cmd_undrain}
    if args.cmd in FEATURE_COMMANDS:
        import importlib

        handlers[args.cmd] = importlib.import_module(FEATURE_COMMANDS[args.cmd]).run
    if args.cmd not in handlers:
        build_parser().print_help()
        return 2
    from gpuguard.config import ConfigError
    from gpuguard.profiles import ProfileError

    try:
        code = handlers[args.cmd](args)
    except (ConfigError, ProfileError, ValueError) as e:
        print(f"gpuguard: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gpuguard history | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a missing or unreadable input file: one line and exit 2 (exit 1 means "would drain")
        if e.filename is None:
            raise
        print(f"gpuguard: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    except RecursionError:  # JSON/YAML nested deeper than Python can follow (e.g. 100000 '['): bad input
        print("gpuguard: error: input nested too deeply to read", file=sys.stderr)
        return 2
    if args.cmd == "check":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # same reason as the hooks: a hung NVML thread must not block exit
    return code
