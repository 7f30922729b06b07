"""`gpuguard nccl parse | sweep | probe | history`: nccl-tests output, the fleet sweep, the fallback probe.

    gpuguard nccl parse FILE [--json]                 # nccl-tests text (any layout) or -J JSON
    gpuguard nccl sweep --partition P [--nodes LIST]  # find and drain the slow node(s)
    gpuguard nccl probe [--backend auto|nccl|gloo] [--nprocs N] [--nccl-tests BINARY] [--json]
    gpuguard nccl history [--json]                    # past sweeps

Exit codes: 0 ok; 1 the command worked and found a problem (slow nodes, failed tests, unreadable input);
2 usage or configuration error; 3 the sweep could not decide (fabric-wide slowness, failed runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from gpuguard.nccl.cli_common import (add_sweep_options, history_path, largest_size, load_cfg,
                                      nodes_from, parse_size_arg, profile_of, read_input, runner_from, say)
from gpuguard.config.yamlutil import NestingError
from gpuguard.nccl import baseline, history
from gpuguard.nccl.fleet import format_report, run_fleet_sweep
from gpuguard.nccl.parse import parse_nccl
from gpuguard.nccl.probe import run_single_node_nccl, run_torch_probe
from gpuguard.nccl.result import NcclParseError
from gpuguard.nccl.sweep import JobCannotStart, SweepError, threshold_resolver
from gpuguard.slurm.client import client_from_config
from gpuguard.util.cliargs import add_config_option
from gpuguard.util.timefmt import iso_utc


def add_parser(sub: Any) -> None:
    p = sub.add_parser("nccl", help="NCCL bandwidth: parse nccl-tests output, sweep the fleet, probe a node")
    ns = p.add_subparsers(dest="nccl_cmd", metavar="SUBCOMMAND")
    s = ns.add_parser("parse", help="parse nccl-tests output (text in any layout, or the -J JSON file)")
    add_config_option(s)
    s.add_argument("file", help="output file ('-' for stdin)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--rows", action="store_true", help="also print every data row")
    s = ns.add_parser("sweep", help="run nccl-tests through Slurm, isolate and drain slow nodes")
    add_config_option(s)
    add_sweep_options(s)
    s.add_argument("--method", choices=("pairwise", "bisect"), help="isolation (default nccl.sweep_method)")
    s.add_argument("--threshold", type=float, help="busbw floor in GB/s for every run (overrides config/baseline)")
    s.add_argument("--no-drain", action="store_true", help="report only")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s = ns.add_parser("probe", help="measure all_reduce bandwidth here (torch.distributed fallback, or nccl-tests)")
    add_config_option(s)
    s.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    s.add_argument("--nprocs", type=int, default=None, help="ranks (default: the GPUs in CUDA_VISIBLE_DEVICES, else 2)")
    s.add_argument("--min-bytes", type=parse_size_arg, default=1 << 20)
    s.add_argument("--max-bytes", type=parse_size_arg, default=64 << 20)
    s.add_argument("--iters", type=int, default=20)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--timeout", type=float, default=600.0)
    s.add_argument("--nccl-tests", metavar="BINARY", help="run this all_reduce_perf instead of the torch probe")
    s.add_argument("--json", action="store_true")
    s = ns.add_parser("history", help="past sweeps from the history store")
    add_config_option(s)
    s.add_argument("--limit", type=int, default=10)
    s.add_argument("--json", action="store_true")


def cmd_nccl_parse(args: argparse.Namespace) -> int:
    text = read_input(args.file)
    try:
        res = parse_nccl(text, strict=True)
    except NestingError as e:  # bad input, not a verdict: exit 2
        print(f"gpuguard: error: {args.file}: {e}", file=sys.stderr)
        return 2
    except NcclParseError as e:
        print(f"gpuguard: {args.file}: {e}", file=sys.stderr)
        return 1
    summary = res.summary()
    found = bool(res.rows) or res.layout is not None or res.footer
    if args.json:
        out = dict(summary)
        if args.rows:
            out["data"] = [[r.size_bytes, r.oop_busbw, r.ip_busbw] for r in res.rows]
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.file}: {summary['rows']} rows, {res.format}"
              + (f" ({res.layout})" if res.layout and res.layout != "json" else "")
              + (f", {res.prefix} prefixes" if res.prefix else ""))
        for key in ("peak_busbw_gbps", "avg_busbw_gbps", "busbw_at_largest_gbps", "largest_size_bytes",
                    "out_of_bounds", "wrong_total", "collective", "nccl_tests_version", "nccl_version", "ranks"):
            if summary.get(key) is not None:
                print(f"  {key:24} {summary[key]}")
        if res.hosts:
            print(f"  {'hosts':24} {', '.join(res.hosts[:8])}" + (" ..." if len(res.hosts) > 8 else ""))
        for w in res.warnings:
            print(f"  warning: {w}")
        for e in res.errors:
            print(f"  error:   {e}")
        if args.rows:
            print(f"  {'size (B)':>14} {'oop busbw':>10} {'ip busbw':>10}")
            for r in res.rows:
                print(f"  {r.size_bytes:14d} {r.oop_busbw if r.oop_busbw is not None else '-':>10} "
                      f"{r.ip_busbw if r.ip_busbw is not None else '-':>10}")
    if not found:
        print(f"gpuguard: {args.file}: no nccl-tests table found", file=sys.stderr)
        return 1
    return 0


def cmd_nccl_sweep(args: argparse.Namespace) -> int:
    cfg = load_cfg(args)
    n = cfg.nccl
    nodes = nodes_from(args)
    if not nodes:
        print("gpuguard: no usable nodes to sweep", file=sys.stderr)
        return 2
    profile = profile_of(cfg, args.profile)
    path = history_path(cfg)
    store = history.open_history(path)
    try:
        largest = largest_size(args.min_bytes or n.sweep_min_bytes, args.max_bytes or n.sweep_max_bytes)
        proposals = baseline.propose(history.samples(store, profile=profile), n.baseline_k,
                                     n.baseline_margin_pct, n.baseline_min_samples)

        def from_baseline(count: int) -> Optional[float]:
            p = baseline.floor_proposal(proposals, profile, count, largest, any_size=True,
                                        backend=baseline.NCCL_TESTS)
            return p.threshold_gbps if p else None

        try:
            threshold_for = threshold_resolver(args.threshold if args.threshold is not None else n.sweep_busbw_gbps,
                                               {} if args.threshold is not None else n.sweep_busbw_by_nodes,
                                               from_baseline)
        except SweepError as e:
            raise ValueError(str(e)) from None
        if threshold_for(len(nodes)) is None or threshold_for(2) is None:
            print("gpuguard: no bus-bandwidth threshold for this sweep: pass --threshold, set nccl.sweep_busbw_gbps "
                  "or nccl.sweep_busbw_by_nodes, or record a baseline (gpuguard baseline measure / propose)",
                  file=sys.stderr)
            return 2
        try:
            runner = runner_from(args, cfg, threshold_for, path)
        except SweepError as e:
            raise ValueError(str(e)) from None
        method = args.method or n.sweep_method
        drain = n.sweep_drain and not args.no_drain
        client = client_from_config(cfg.slurm, cfg.deadlines.scontrol_s) if drain else None
        say(f"sweeping {len(nodes)} nodes ({method}), threshold {threshold_for(len(nodes)):g} GB/s for the "
             f"all-node run, {threshold_for(2):g} GB/s for pairs; outputs in {runner.workdir}")
        try:
            rec = run_fleet_sweep(nodes, runner, method=method, partition=args.partition, profile=profile,
                                  store=store, slurm_client=client, drain=drain,
                                  max_drain_fraction=n.sweep_max_drain_fraction, progress=say)
        except JobCannotStart as e:
            print(f"gpuguard: sweep stopped: {e}", file=sys.stderr)
            return 3
    finally:
        store.close()
    print_sweep(args, cfg, rec, runner.template_used, method)
    if rec.outcome.conclusion == "pass":
        return 0
    return 1 if rec.outcome.conclusion == "isolated" else 3


def print_sweep(args: argparse.Namespace, cfg: Any, rec: Any, template: Any, method: str) -> None:
    """The sweep's report, with a table per leaf switch where Slurm has a topology."""
    from gpuguard.nccl.fleet import per_switch
    from gpuguard.slurm.topology import topology_from_config

    switches = topology_from_config(cfg.slurm, cfg.deadlines.scontrol_s)  # {} without one: no per-switch table
    if args.json:
        out = rec.outcome.to_dict()
        out.update(sweep_id=rec.sweep_id, duration_s=round(rec.duration_s, 2), drained=rec.drained,
                   template=template, switches=per_switch(rec.outcome, switches))
        print(json.dumps(out, indent=2, default=str))
    else:
        sys.stdout.write(format_report(rec, args.partition, method, switches))


def cmd_nccl_probe(args: argparse.Namespace) -> int:
    nprocs = args.nprocs
    if nprocs is None:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        nprocs = len([x for x in cvd.split(",") if x.strip()]) or 2
    if args.nccl_tests:
        obs = run_single_node_nccl(args.nccl_tests, gpus=nprocs, timeout_s=args.timeout, min_bytes=args.min_bytes,
                                   max_bytes=args.max_bytes, iterations=args.iters, warmup=args.warmup)
    else:
        obs = run_torch_probe(nprocs=nprocs, timeout_s=args.timeout, min_bytes=args.min_bytes,
                              max_bytes=args.max_bytes, iterations=args.iters, warmup=args.warmup, backend=args.backend)
    summary = obs.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        if obs.result is not None and obs.result.rows:
            print(f"{obs.backend}: {len(obs.result.rows)} sizes, {nprocs} ranks")
            for r in obs.result.rows:
                print(f"  {r.size_bytes:12d} B  {r.oop_time_us or 0:10.1f} us  algbw {r.oop_algbw or 0:8.2f}  "
                      f"busbw {r.busbw or 0:8.2f} GB/s")
            print(f"peak busbw {summary['peak_busbw_gbps']} GB/s, avg {summary['avg_busbw_gbps']} GB/s, "
                  f"out of bounds {summary['out_of_bounds']}")
        else:
            print(f"{obs.backend}: no result: {obs.status.error or obs.error}")
    if obs.tool_missing:
        return 2
    return 0 if obs.result is not None and obs.result.rows and not obs.result.out_of_bounds else 1


def cmd_nccl_history(args: argparse.Namespace) -> int:
    cfg = load_cfg(args)
    with history.open_history(history_path(cfg)) as store:
        rows = history.sweeps(store, args.limit)
        for r in rows:
            r["runs"] = history.runs_of(store, r["id"])
            r.pop("report", None)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not rows:
        print("no sweeps recorded")
    for r in rows:
        when = iso_utc(r["started"])
        print(f"#{r['id']} {when} {r['nodes']} {r['method']} -> {r['conclusion']} slow={r['slow_nodes']}")
        for run in r["runs"]:
            print(f"    {run['stage']:8} {run['nodes']:20} job {run['job_id'] or '-':>6} "
                  f"{run['busbw_gbps'] if run['busbw_gbps'] is not None else '-':>8} GB/s  {run['verdict']}")
    return 0


def run(args: argparse.Namespace) -> int:
    handler = {"parse": cmd_nccl_parse, "sweep": cmd_nccl_sweep, "probe": cmd_nccl_probe,
               "history": cmd_nccl_history}.get(args.nccl_cmd or "")
    if handler is None:
        print("usage: gpuguard nccl SUBCOMMAND (see gpuguard nccl --help)", file=sys.stderr)
        return 2
    return handler(args)
