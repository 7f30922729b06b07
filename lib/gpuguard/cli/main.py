"""`gpuguard` command line: dispatch to the module of the command being run. The hooks take a path of their own
(gpuguard.cli.hooks) that imports nothing else: the prolog runs before every job."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from gpuguard.util.cliargs import add_config_option, hoist_config

HOOK_KINDS = ("prolog", "epilog", "healthcheck")

# Every command lives with its feature: the module named here exposes `add_parser(subparsers) -> None` and
# `run(args) -> int`; only the module of the command being run is imported (never on the hooks' hot path).
FEATURE_COMMANDS: dict[str, str] = {
    **{name: "gpuguard.cli.commands" for name in ("check", "xid", "profiles", "config", "undrain", "slurm-conf",
                                                 "simulate")},
    "status": "gpuguard.cli.status",
    "history": "gpuguard.cli.history",
    "watch": "gpuguard.watch.daemon",
    "render": "gpuguard.templates.cli",
    "templates": "gpuguard.templates.cli",
    "lint": "gpuguard.templates.cli",
    "job-attempt": "gpuguard.templates.jobattempt_cli",
    "nccl": "gpuguard.nccl.cli",
    "efa": "gpuguard.nccl.efa_cli",
    "dcgm": "gpuguard.nccl.dcgm_cli",
    "baseline": "gpuguard.nccl.baseline_cli",
    "preflight": "gpuguard.preflight.cli",
    "monitor": "gpuguard.monitor.cli",
    "trainlog": "gpuguard.trainlog.cli",
    "fleet": "gpuguard.cli.fleet",
}


def build_parser(only_feature: Optional[str] = None) -> argparse.ArgumentParser:
    """The full parser. `only_feature`: import just that feature module (the command being run), so a
    broken or missing optional module cannot take every other command down with it."""
    from gpuguard import __version__

    ap = argparse.ArgumentParser(prog="gpuguard", description="Keep GPU training clusters healthy under Slurm.")
    ap.add_argument("-V", "--version", action="version", version=f"gpuguard {__version__}")
    add_config_option(ap, top_level=True)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    for kind, helptext in (("prolog", "slurmd Prolog= entry point: pre-flight the job's GPUs, drain on failure"),
                           ("epilog", "slurmd Epilog= entry point: check the node after the job"),
                           ("healthcheck", "slurmd HealthCheckProgram= entry point: scan all GPUs")):
        p = sub.add_parser(kind, help=helptext)
        add_config_option(p)
        p.add_argument("--simulate", metavar="SCENARIO", help="run against a simulated node")

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
    """The hooks' options as argparse would take them (`gpuguard prolog --help` in the full parser); the hooks
    themselves parse them by hand (gpuguard.cli.hooks.parse_hook_args)."""
    p = argparse.ArgumentParser(prog=f"gpuguard {kind}")
    p.add_argument("kind", choices=HOOK_KINDS)
    add_config_option(p, top_level=True)
    p.add_argument("--simulate", metavar="SCENARIO", help="run against a simulated node")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["--version"], ["-V"]):  # without importing every feature module
        from gpuguard import __version__

        print(f"gpuguard {__version__}")
        return 0
    lead, rest = hoist_config(argv)  # `--config FILE` before the command: the command's own, if it names none
    # The hooks have their own entry (gpuguard.cli.hooks, what the hook scripts run): no argparse, nothing else
    if rest and rest[0] in HOOK_KINDS:
        from gpuguard.cli import hooks

        return hooks.main([rest[0], *lead, *rest[1:]])
    if rest[:2] == ["xid", "scan"]:  # lean path: a 1 GiB log scans in grep's time only without the full CLI
        from gpuguard.cli import xidscan

        return xidscan.main([*lead, *rest[2:]])
    cmd = next((a for a in rest if not a.startswith("-")), None)
    args = build_parser(FEATURE_COMMANDS.get(cmd or "")).parse_args(argv)
    if args.cmd not in FEATURE_COMMANDS:
        build_parser().print_help()
        return 2
    import importlib

    handler = importlib.import_module(FEATURE_COMMANDS[args.cmd]).run
    from gpuguard.config.schema import ConfigError
    from gpuguard.profiles import ProfileError

    try:
        code = handler(args)
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
