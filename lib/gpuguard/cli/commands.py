"""The node's own commands: `check`, `xid`, `profiles`, `config`, `undrain`, `slurm-conf`, `simulate`. Each is a
thin wrapper around the module that does the work."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from gpuguard.util.cliargs import add_config_option

COMMANDS = ("check", "xid", "profiles", "config", "undrain", "slurm-conf", "simulate")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("check", help="run the checks by hand and print a report")
    add_config_option(p)
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
    add_config_option(e)
    e.add_argument("code", type=int)

    p = sub.add_parser("slurm-conf", help="print the slurm.conf lines gpuguard needs, with why")
    p.add_argument("--prefix", default="/usr/local", help="where gpuguard is installed (default /usr/local)")

    p = sub.add_parser("profiles", help="list instance profiles, or show one")
    add_config_option(p)
    p.add_argument("name", nargs="?")

    p = sub.add_parser("config", help="validate a config file and print the effective settings")
    add_config_option(p)
    p.add_argument("--check", metavar="FILE", help="validate FILE before deploying it: every bad key with its line; "
                   "exit 1 when there is any")

    p = sub.add_parser("undrain", help="lift a drain gpuguard put on a node (admin)")
    add_config_option(p)
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


def run(args: argparse.Namespace) -> int:
    handlers = {"check": cmd_check, "xid": cmd_xid, "profiles": cmd_profiles, "config": cmd_config,
                "slurm-conf": cmd_slurm_conf, "simulate": cmd_simulate, "undrain": cmd_undrain}
    return handlers[args.cmd](args)


def cmd_check(args: argparse.Namespace) -> int:
    from gpuguard.siteconfig import load_config
    from gpuguard.context import RunContext, context_from_env, parse_gpu_list
    from gpuguard.pipeline.run import execute
    from gpuguard.cli.report import print_report
    from gpuguard.simulate.sources import resolve_sources

    cfg = load_config(args.config)
    base = context_from_env(args.context if args.context != "manual" else "manual", os.environ, node=args.node
                            or cfg.node.name)
    gpus = parse_gpu_list(args.gpus) if args.gpus else (base.gpu_indices if args.context in ("prolog", "epilog")
                                                        else None)
    ctx = RunContext(kind=args.context, node=base.node, job_id=base.job_id, job_user=base.job_user,
                     gpu_indices=gpus, restart_count=base.restart_count, exclusive=base.exclusive)
    result = execute(ctx, cfg, resolve_sources(cfg, ctx.node, args.simulate), dry_run=args.dry_run)
    print_report(result, args.json, verbose=args.verbose)
    return result.exit_code


def cmd_xid(args: argparse.Namespace) -> int:
    if args.xid_cmd == "explain":
        from gpuguard.siteconfig import load_config
        from gpuguard.xid.catalog import load_catalog

        overrides = load_config(args.config).xid.overrides if args.config else None
        print(load_catalog(overrides=overrides or None).explain(args.code))
        return 0
    if args.xid_cmd == "scan":
        from gpuguard.cli import xidscan

        return xidscan.run(args)
    print("usage: gpuguard xid {scan,explain} ...", file=sys.stderr)
    return 2


def cmd_profiles(args: argparse.Namespace) -> int:
    import dataclasses

    from gpuguard.siteconfig import load_config
    from gpuguard.profiles import list_profiles, load_profile

    extra = load_config(args.config).node.profile_dir if args.config else None
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

    from gpuguard.siteconfig import load_config

    if args.check:
        from gpuguard.siteconfig import check_file

        issues = check_file(args.check)
        for issue in issues:
            print(f"{args.check}: {issue}")
        for warning in _advice(args.check) if not issues else []:
            print(f"{args.check}: WARNING: {warning}")
        print(f"{args.check}: {'INVALID: ' + str(len(issues)) + ' problem(s)' if issues else 'valid'}")
        return 1 if issues else 0

    cfg = load_config(args.config)
    print(f"# {cfg.source}: valid (secrets redacted)")
    print(json.dumps({"sections": cfg.redacted_mapping(), "checks": cfg.checks.as_mapping()}, indent=2,
                     default=str))
    return 0


def _advice(path: str) -> list[str]:
    """Warnings for a valid file (gpuguard.config.advice): paths root will refuse, the cluster label."""
    from gpuguard.config.advice import config_advice
    from gpuguard.siteconfig import load_config

    return config_advice(load_config(path))


def cmd_undrain(args: argparse.Namespace) -> int:
    """The admin's undrain (gpuguard.pipeline.admin): ownership rules and a re-check unless --force."""
    from gpuguard.siteconfig import load_config
    from gpuguard.util.log import HookLog
    from gpuguard.pipeline.admin import admin_undrain
    from gpuguard.simulate.sources import resolve_sources

    cfg = load_config(args.config)
    lg = cfg.logging
    out = admin_undrain(cfg, args.node, args.force, HookLog(lg.syslog, lg.file, lg.level, stderr=False),
                        resolve_sources)
    print(out.message if out.code == 0 else f"gpuguard: {out.message}", file=sys.stdout if out.code == 0 else sys.stderr)
    return out.code


def cmd_slurm_conf(args: argparse.Namespace) -> int:
    from gpuguard.slurm.conf import recommended_lines

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
