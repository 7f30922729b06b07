"""`gpuguard baseline show | propose | record | measure`: measured busbw per (profile, nodes, size) and the
thresholds it proposes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from gpuguard.nccl.cli_common import (add_sweep_options, history_path, load_cfg, nodes_from,
                                      profile_of, read_input, runner_from)
from gpuguard.nccl import baseline, history
from gpuguard.nccl.parse import parse_nccl
from gpuguard.nccl.sweep import SweepError
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.util.cliargs import add_config_option


def add_parser(sub: Any) -> None:
    p = sub.add_parser("baseline", help="measured busbw per (profile, nodes, size) and proposed thresholds")
    bs = p.add_subparsers(dest="baseline_cmd", metavar="SUBCOMMAND")
    s = bs.add_parser("show", help="the recorded distribution per (profile, node count, message size)")
    add_config_option(s)
    s.add_argument("--profile")
    s.add_argument("--json", action="store_true")
    s = bs.add_parser("propose", help="thresholds from the distribution, with the config lines to use them")
    add_config_option(s)
    s.add_argument("--profile")
    s.add_argument("--json", action="store_true")
    s = bs.add_parser("record", help="record nccl-tests outputs as samples")
    add_config_option(s)
    s.add_argument("--profile", required=True)
    s.add_argument("--nodes", type=int, required=True, help="how many nodes the runs spanned")
    s.add_argument("files", nargs="+")
    s = bs.add_parser("measure", help="run nccl-tests on disjoint groups of nodes through Slurm and record them")
    add_config_option(s)
    add_sweep_options(s)
    s.add_argument("--group-size", type=int, default=2, help="nodes per run (default 2)")


def _proposals(cfg: Any, profile: Optional[str]) -> list[Any]:
    n = cfg.nccl
    with history.open_history(history_path(cfg)) as store:
        rows = history.samples(store, profile=profile)
    return baseline.propose(rows, n.baseline_k, n.baseline_margin_pct, n.baseline_min_samples)


def cmd_baseline(args: argparse.Namespace) -> int:
    cfg = load_cfg(args)
    if args.baseline_cmd in ("show", "propose"):
        props = _proposals(cfg, args.profile)
        if args.baseline_cmd == "propose":
            best: dict[tuple[str, str, int], Any] = {}
            for p in props:
                key = (p.profile, p.backend, p.n_nodes)
                if key not in best or p.size_bytes > best[key].size_bytes:
                    best[key] = p
            props = sorted(best.values(), key=lambda p: (p.profile, p.backend, p.n_nodes))
        if args.json:
            print(json.dumps([p.to_dict() for p in props], indent=2))
            return 0
        if not props:
            print("no samples recorded yet: gpuguard baseline measure --partition P, or run gpuguard nccl sweep")
            return 0
        print(f"{'profile':16} {'backend':10} {'nodes':>5} {'size (B)':>12} {'n':>4} {'median':>8} {'MAD':>6} "
              f"{'p05':>8} {'min':>8} {'threshold':>10}  sources")
        for p in props:
            thr = f"{p.threshold_gbps:.1f}" if p.threshold_gbps is not None else "-"
            print(f"{p.profile:16} {p.backend or '?':10} {p.n_nodes:5d} {p.size_bytes:12d} {p.samples:4d} "
                  f"{p.median:8.1f} {p.mad:6.1f} "
                  f"{p.p05:8.1f} {p.minimum:8.1f} {thr:>10}  {p.sources}" + (f"  ({p.note})" if p.note else ""))
        if args.baseline_cmd == "propose":
            print("\n# proposed config (threshold = median - max(k*1.4826*MAD, margin% of median)):")
            sys.stdout.write(baseline.config_snippet(props))
        return 0
    if args.baseline_cmd == "record":
        total = 0
        with history.open_history(history_path(cfg)) as store:
            for f in args.files:
                res = parse_nccl(read_input(f))
                if not res.rows:
                    print(f"gpuguard: {f}: no nccl-tests rows, nothing recorded", file=sys.stderr)
                    continue
                total += history.record_samples(store, baseline.samples_from_result(
                    res, args.profile, args.nodes, ",".join(res.hosts) or "?", "file"))
        print(f"recorded {total} samples ({args.profile}, {args.nodes} nodes)")
        return 0 if total else 1
    if args.baseline_cmd == "measure":
        return _baseline_measure(args, cfg)
    print("usage: gpuguard baseline show|propose|record|measure", file=sys.stderr)
    return 2


def _baseline_measure(args: argparse.Namespace, cfg: Any) -> int:
    nodes = nodes_from(args)
    size = max(1, args.group_size)
    groups = [tuple(nodes[i:i + size]) for i in range(0, len(nodes) - size + 1, size)]
    if not groups:
        print(f"gpuguard: {len(nodes)} nodes cannot form a group of {size}", file=sys.stderr)
        return 2
    profile = profile_of(cfg, args.profile)
    path = history_path(cfg)
    try:
        runner = runner_from(args, cfg, lambda _n: None, path)
    except SweepError as e:
        raise ValueError(str(e)) from None
    measurements = runner(groups, "baseline")
    total = 0
    with history.open_history(path) as store:
        for m in measurements:
            history.record_run(store, sweep_id=None, stage="baseline", nodes=compress_hostlist(list(m.nodes)),
                               n_nodes=len(m.nodes), job_id=m.job_id, job_state=m.job_state, busbw_gbps=m.busbw_gbps,
                               size_bytes=m.size_bytes, peak_busbw_gbps=m.result.peak_busbw_gbps if m.result else None,
                               avg_busbw_gbps=m.result.avg_busbw_gbps if m.result else None, threshold_gbps=None,
                               verdict=m.verdict, error=m.error, output=m.output_path)
            if m.result is not None and m.busbw_gbps is not None and not m.wrong:
                total += history.record_samples(store, baseline.samples_from_result(
                    m.result, profile, len(m.nodes), compress_hostlist(list(m.nodes)), "measure", m.job_id))
    for m in measurements:
        print(f"{compress_hostlist(list(m.nodes)):24} job {m.job_id or '-':>6} "
              + (f"{m.busbw_gbps:8.1f} GB/s at {m.size_bytes} B" if m.busbw_gbps is not None else f"ERROR {m.error}"))
    print(f"recorded {total} samples for {profile}, {size}-node runs; see gpuguard baseline propose")
    return 0 if all(m.busbw_gbps is not None for m in measurements) else 1


def run(args: argparse.Namespace) -> int:
    if not args.baseline_cmd:
        print("usage: gpuguard baseline show|propose|record|measure", file=sys.stderr)
        return 2
    return cmd_baseline(args)
