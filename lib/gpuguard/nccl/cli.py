"""`gpuguard nccl | efa | dcgm | baseline`: parsers, the fleet sweep, the fallback probe and baselines.

    gpuguard nccl parse FILE [--json]                 # nccl-tests text (any layout) or -J JSON
    gpuguard nccl sweep --partition P [--nodes LIST]  # find and drain the slow node(s)
    gpuguard nccl probe [--backend auto|nccl|gloo] [--nprocs N] [--nccl-tests BINARY] [--json]
    gpuguard nccl history [--json]                    # past sweeps
    gpuguard efa parse-fi-info FILE [--json]
    gpuguard dcgm parse FILE [--json]   (dcgmi diag -j output, or the table dcgmi diag prints without -j)
    gpuguard baseline show|propose|record|measure ...

Exit codes: 0 ok; 1 the command worked and found a problem (slow nodes, failed tests, unreadable input);
2 usage or configuration error; 3 the sweep could not decide (fabric-wide slowness, failed runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

COMMANDS = ("nccl", "efa", "dcgm", "baseline")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config file (default $GPUGUARD_CONFIG or /etc/gpuguard/config.yaml)")


def _size(text: str) -> int:
    from gpuguard.nccl.parse import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partition", help="Slurm partition (nodes default to its usable nodes)")
    p.add_argument("--nodes", help="hostlist to sweep, e.g. node[1-16] (default: the partition's usable nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default nccl.sweep_gpus_per_node)")
    p.add_argument("--binary", help="all_reduce_perf on the compute nodes (default nccl.sweep_binary / nccl.binary)")
    p.add_argument("--min-bytes", type=_size, help="smallest message, e.g. 1G (default nccl.sweep_min_bytes)")
    p.add_argument("--max-bytes", type=_size, help="largest message, e.g. 16G (default nccl.sweep_max_bytes)")
    p.add_argument("--iters", type=int, help="iterations per size (default nccl.sweep_iterations)")
    p.add_argument("--time-limit", help="job time limit [D-]HH:MM:SS (default nccl.sweep_time_limit)")
    p.add_argument("--profile", help="profile the baseline samples are filed under (default node.profile)")
    p.add_argument("--workdir", help="directory for job scripts and outputs, on a filesystem the nodes share")
    p.add_argument("--job-timeout", type=float, help="seconds a round of jobs may take (default nccl.sweep_job_timeout_s)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("nccl", help="NCCL bandwidth: parse nccl-tests output, sweep the fleet, probe a node")
    ns = p.add_subparsers(dest="nccl_cmd", metavar="SUBCOMMAND")
    s = ns.add_parser("parse", help="parse nccl-tests output (text in any layout, or the -J JSON file)")
    _common(s)
    s.add_argument("file", help="output file ('-' for stdin)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--rows", action="store_true", help="also print every data row")
    s = ns.add_parser("sweep", help="run nccl-tests through Slurm, isolate and drain slow nodes")
    _common(s)
    _sweep_options(s)
    s.add_argument("--method", choices=("pairwise", "bisect"), help="isolation (default nccl.sweep_method)")
    s.add_argument("--threshold", type=float, help="busbw floor in GB/s for every run (overrides config/baseline)")
    s.add_argument("--no-drain", action="store_true", help="report only")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s = ns.add_parser("probe", help="measure all_reduce bandwidth here (torch.distributed fallback, or nccl-tests)")
    _common(s)
    s.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    s.add_argument("--nprocs", type=int, default=None, help="ranks (default: the GPUs in CUDA_VISIBLE_DEVICES, else 2)")
    s.add_argument("--min-bytes", type=_size, default=1 << 20)
    s.add_argument("--max-bytes", type=_size, default=64 << 20)
    s.add_argument("--iters", type=int, default=20)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--timeout", type=float, default=600.0)
    s.add_argument("--nccl-tests", metavar="BINARY", help="run this all_reduce_perf instead of the torch probe")
    s.add_argument("--json", action="store_true")
    s = ns.add_parser("history", help="past sweeps from the history store")
    _common(s)
    s.add_argument("--limit", type=int, default=10)
    s.add_argument("--json", action="store_true")

    p = sub.add_parser("efa", help="EFA tools")
    es = p.add_subparsers(dest="efa_cmd", metavar="SUBCOMMAND")
    s = es.add_parser("parse-fi-info", help="count EFA devices in `fi_info -p efa` output")
    _common(s)
    s.add_argument("file", help="output file ('-' for stdin)")
    s.add_argument("--json", action="store_true")

    p = sub.add_parser("dcgm", help="DCGM tools")
    ds = p.add_subparsers(dest="dcgm_cmd", metavar="SUBCOMMAND")
    s = ds.add_parser("parse", help="per-test, per-GPU results of `dcgmi diag -j` output or of the table "
                                    "`dcgmi diag` prints without -j")
    _common(s)
    s.add_argument("file", help="output file ('-' for stdin)")
    s.add_argument("--json", action="store_true")

    p = sub.add_parser("baseline", help="measured busbw per (profile, nodes, size) and proposed thresholds")
    bs = p.add_subparsers(dest="baseline_cmd", metavar="SUBCOMMAND")
    s = bs.add_parser("show", help="the recorded distribution per (profile, node count, message size)")
    _common(s)
    s.add_argument("--profile")
    s.add_argument("--json", action="store_true")
    s = bs.add_parser("propose", help="thresholds from the distribution, with the config lines to use them")
    _common(s)
    s.add_argument("--profile")
    s.add_argument("--json", action="store_true")
    s = bs.add_parser("record", help="record nccl-tests outputs as samples")
    _common(s)
    s.add_argument("--profile", required=True)
    s.add_argument("--nodes", type=int, required=True, help="how many nodes the runs spanned")
    s.add_argument("files", nargs="+")
    s = bs.add_parser("measure", help="run nccl-tests on disjoint groups of nodes through Slurm and record them")
    _common(s)
    _sweep_options(s)
    s.add_argument("--group-size", type=int, default=2, help="nodes per run (default 2)")


# --------------------------------------------------------------------------- helpers


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def _say(msg: str, t0: float = time.monotonic()) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _cfg(args: argparse.Namespace) -> Any:
    from gpuguard.config import load_config

    return load_config(getattr(args, "config", None))


def history_path(cfg: Any) -> str:
    n = cfg.sections["nccl"]
    return n["history_path"] or cfg.sections["store"]["path"].replace("{node}", "fleet")


def _profile(cfg: Any, explicit: Optional[str]) -> str:
    if explicit:
        return explicit
    name = cfg.sections["node"]["profile"]
    return "generic" if name == "auto" else str(name)


# --------------------------------------------------------------------------- nccl


def cmd_nccl_parse(args: argparse.Namespace) -> int:
    from gpuguard.nccl.parse import NcclParseError, parse_nccl
    from gpuguard.yamlutil import NestingError

    text = _read(args.file)
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


def _runner_from(args: argparse.Namespace, cfg: Any, threshold_for: Any, store_path: str) -> Any:
    from gpuguard.nccl.sweep import JobSpec, SlurmRunner, default_workdir

    n = cfg.sections["nccl"]
    spec = JobSpec(partition=args.partition, gpus_per_node=args.gpus_per_node or n["sweep_gpus_per_node"],
                   binary=args.binary or n["sweep_binary"] or n["binary"],
                   min_bytes=args.min_bytes or n["sweep_min_bytes"], max_bytes=args.max_bytes or n["sweep_max_bytes"],
                   iterations=args.iters or n["sweep_iterations"], time_limit=args.time_limit or n["sweep_time_limit"],
                   preset=n["sweep_preset"], mpi=n["sweep_mpi"])
    if spec.max_bytes < spec.min_bytes:
        raise ValueError(f"--max-bytes {spec.max_bytes} is below --min-bytes {spec.min_bytes}")
    workdir = args.workdir or n["sweep_workdir"] or default_workdir(store_path)
    if n["sweep_workdir"] and not args.workdir:
        workdir = os.path.join(workdir, time.strftime("%Y%m%d-%H%M%S"))
    return SlurmRunner(spec, workdir, threshold_for, job_timeout_s=args.job_timeout or n["sweep_job_timeout_s"],
                       progress=_say)


def _nodes_from(args: argparse.Namespace) -> list[str]:
    from gpuguard.hostlist import HostlistError, expand_hostlist
    from gpuguard.nccl.sweep import SweepError, partition_nodes

    if args.nodes:
        try:
            return expand_hostlist(args.nodes)
        except HostlistError as e:
            raise ValueError(f"--nodes: {e}") from None
    if not args.partition:
        raise ValueError("give --partition and/or --nodes")
    try:
        nodes, skipped = partition_nodes(args.partition)
    except SweepError as e:
        raise ValueError(str(e)) from None
    for name, state in skipped.items():
        _say(f"skipping {name}: {state}")
    return nodes


def _largest_size(min_bytes: int, max_bytes: int) -> int:
    size = min_bytes
    while size * 2 <= max_bytes:
        size *= 2
    return size


def cmd_nccl_sweep(args: argparse.Namespace) -> int:
    from gpuguard.nccl import baseline, history
    from gpuguard.nccl.fleet import format_report, run_fleet_sweep
    from gpuguard.nccl.sweep import SweepError, threshold_resolver
    from gpuguard.slurm import client_from_config

    cfg = _cfg(args)
    n = cfg.sections["nccl"]
    nodes = _nodes_from(args)
    if not nodes:
        print("gpuguard: no usable nodes to sweep", file=sys.stderr)
        return 2
    profile = _profile(cfg, args.profile)
    path = history_path(cfg)
    store = history.open_history(path)
    try:
        largest = _largest_size(args.min_bytes or n["sweep_min_bytes"], args.max_bytes or n["sweep_max_bytes"])
        proposals = baseline.propose(history.samples(store, profile=profile), n["baseline_k"],
                                     n["baseline_margin_pct"], n["baseline_min_samples"])

        def from_baseline(count: int) -> Optional[float]:
            p = baseline.best_for(proposals, profile, count, largest) or baseline.best_for(proposals, profile, count)
            return p.threshold_gbps if p else None

        try:
            threshold_for = threshold_resolver(args.threshold if args.threshold is not None else n["sweep_busbw_gbps"],
                                               {} if args.threshold is not None else n["sweep_busbw_by_nodes"],
                                               from_baseline)
        except SweepError as e:
            raise ValueError(str(e)) from None
        if threshold_for(len(nodes)) is None or threshold_for(2) is None:
            print("gpuguard: no bus-bandwidth threshold for this sweep: pass --threshold, set nccl.sweep_busbw_gbps "
                  "or nccl.sweep_busbw_by_nodes, or record a baseline (gpuguard baseline measure / propose)",
                  file=sys.stderr)
            return 2
        try:
            runner = _runner_from(args, cfg, threshold_for, path)
        except SweepError as e:
            raise ValueError(str(e)) from None
        method = args.method or n["sweep_method"]
        drain = n["sweep_drain"] and not args.no_drain
        client = client_from_config(cfg.sections["slurm"], cfg.sections["deadlines"]["scontrol_s"]) if drain else None
        _say(f"sweeping {len(nodes)} nodes ({method}), threshold {threshold_for(len(nodes)):g} GB/s for the "
             f"all-node run, {threshold_for(2):g} GB/s for pairs; outputs in {runner.workdir}")
        rec = run_fleet_sweep(nodes, runner, method=method, partition=args.partition, profile=profile, store=store,
                              slurm_client=client, drain=drain,
                              max_drain_fraction=n["sweep_max_drain_fraction"], progress=_say)
    finally:
        store.close()
    if args.json:
        out = rec.outcome.to_dict()
        out.update(sweep_id=rec.sweep_id, duration_s=round(rec.duration_s, 2), drained=rec.drained,
                   template=runner.template_used)
        print(json.dumps(out, indent=2, default=str))
    else:
        sys.stdout.write(format_report(rec, args.partition, method))
    if rec.outcome.conclusion == "pass":
        return 0
    return 1 if rec.outcome.conclusion == "isolated" else 3


def cmd_nccl_probe(args: argparse.Namespace) -> int:
    from gpuguard.nccl.probe import run_single_node_nccl, run_torch_probe

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
    from gpuguard.nccl import history

    cfg = _cfg(args)
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
        from gpuguard.timefmt import iso_utc

        when = iso_utc(r["started"])
        print(f"#{r['id']} {when} {r['nodes']} {r['method']} -> {r['conclusion']} slow={r['slow_nodes']}")
        for run in r["runs"]:
            print(f"    {run['stage']:8} {run['nodes']:20} job {run['job_id'] or '-':>6} "
                  f"{run['busbw_gbps'] if run['busbw_gbps'] is not None else '-':>8} GB/s  {run['verdict']}")
    return 0


# --------------------------------------------------------------------------- efa / dcgm


def cmd_efa_parse(args: argparse.Namespace) -> int:
    from gpuguard.probes.fabric import parse_fi_info

    info = parse_fi_info(_read(args.file))
    out = {"devices": info.devices, "domains": info.domains, "provider_found": info.provider_found,
           "error": info.error}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.file}: {info.devices} EFA device(s)" + (f": {', '.join(info.domains)}" if info.domains else ""))
        if info.error:
            print(f"  error: {info.error}")
    return 0 if info.provider_found else 1


def cmd_dcgm_parse(args: argparse.Namespace) -> int:
    from gpuguard.probes.dcgm import SEVERITY_NAMES, DcgmParseError, parse_dcgm_diag

    try:
        obs = parse_dcgm_diag(_read(args.file))
    except RecursionError:  # json's decoder on input like 100000 '[': bad input, exit 2
        print(f"gpuguard: error: {args.file}: JSON nested too deeply to read", file=sys.stderr)
        return 2
    except DcgmParseError as e:
        print(f"gpuguard: {args.file}: {e}", file=sys.stderr)
        return 1
    tests = [{"category": t.category, "test": t.name, "status": t.status, "failed_gpus": t.failed_gpus,
              "messages": t.messages, "severity": SEVERITY_NAMES.get(t.max_severity) if t.max_severity is not None else None,
              "info": t.summary_info + [i for r in t.results for i in r.info]} for t in obs.tests]
    if args.json:
        print(json.dumps({"version": obs.version, "driver_version": obs.driver_version, "error": obs.error,
                          "tests": tests}, indent=2))
    else:
        print(f"{args.file}: DCGM {obs.version or '?'}, driver {obs.driver_version or '?'}, {len(tests)} tests")
        for t in tests:
            sev = f" [{t['severity']}]" if t["severity"] else ""
            gpus = f" GPU {','.join(map(str, t['failed_gpus']))}" if t["failed_gpus"] else ""
            print(f"  {t['status']:5} {t['category'] + '/' + t['test']:45}{gpus}{sev}")
            for m in t["messages"]:
                print(f"        {m}")
        if obs.error:
            print(f"  error: {obs.error}")
    return 1 if any(t["status"] == "fail" for t in tests) or obs.error else 0


# --------------------------------------------------------------------------- baseline


def _proposals(cfg: Any, profile: Optional[str]) -> list[Any]:
    from gpuguard.nccl import baseline, history

    n = cfg.sections["nccl"]
    with history.open_history(history_path(cfg)) as store:
        rows = history.samples(store, profile=profile)
    return baseline.propose(rows, n["baseline_k"], n["baseline_margin_pct"], n["baseline_min_samples"])


def cmd_baseline(args: argparse.Namespace) -> int:
    from gpuguard.nccl import baseline, history
    from gpuguard.nccl.parse import parse_nccl

    cfg = _cfg(args)
    if args.baseline_cmd in ("show", "propose"):
        props = _proposals(cfg, args.profile)
        if args.baseline_cmd == "propose":
            best: dict[tuple[str, int], Any] = {}
            for p in props:
                key = (p.profile, p.n_nodes)
                if key not in best or p.size_bytes > best[key].size_bytes:
                    best[key] = p
            props = sorted(best.values(), key=lambda p: (p.profile, p.n_nodes))
        if args.json:
            print(json.dumps([p.to_dict() for p in props], indent=2))
            return 0
        if not props:
            print("no samples recorded yet: gpuguard baseline measure --partition P, or run gpuguard nccl sweep")
            return 0
        print(f"{'profile':16} {'nodes':>5} {'size (B)':>12} {'n':>4} {'median':>8} {'MAD':>6} {'p05':>8} "
              f"{'min':>8} {'threshold':>10}")
        for p in props:
            thr = f"{p.threshold_gbps:.1f}" if p.threshold_gbps is not None else "-"
            print(f"{p.profile:16} {p.n_nodes:5d} {p.size_bytes:12d} {p.samples:4d} {p.median:8.1f} {p.mad:6.1f} "
                  f"{p.p05:8.1f} {p.minimum:8.1f} {thr:>10}" + (f"  ({p.note})" if p.note else ""))
        if args.baseline_cmd == "propose":
            print("\n# proposed config (threshold = median - max(k*1.4826*MAD, margin% of median)):")
            sys.stdout.write(baseline.config_snippet(props))
        return 0
    if args.baseline_cmd == "record":
        total = 0
        with history.open_history(history_path(cfg)) as store:
            for f in args.files:
                res = parse_nccl(_read(f))
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
    from gpuguard.nccl import baseline, history
    from gpuguard.hostlist import compress_hostlist
    from gpuguard.nccl.sweep import SweepError

    nodes = _nodes_from(args)
    size = max(1, args.group_size)
    groups = [tuple(nodes[i:i + size]) for i in range(0, len(nodes) - size + 1, size)]
    if not groups:
        print(f"gpuguard: {len(nodes)} nodes cannot form a group of {size}", file=sys.stderr)
        return 2
    profile = _profile(cfg, args.profile)
    path = history_path(cfg)
    try:
        runner = _runner_from(args, cfg, lambda _n: None, path)
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


# --------------------------------------------------------------------------- dispatch


def run(args: argparse.Namespace) -> int:
    if args.cmd == "nccl":
        handler = {"parse": cmd_nccl_parse, "sweep": cmd_nccl_sweep, "probe": cmd_nccl_probe,
                   "history": cmd_nccl_history}.get(args.nccl_cmd or "")
    elif args.cmd == "efa":
        handler = cmd_efa_parse if args.efa_cmd == "parse-fi-info" else None
    elif args.cmd == "dcgm":
        handler = cmd_dcgm_parse if args.dcgm_cmd == "parse" else None
    elif args.cmd == "baseline":
        handler = cmd_baseline if args.baseline_cmd else None
    else:
        handler = None
    if handler is None:
        print(f"usage: gpuguard {args.cmd} SUBCOMMAND (see gpuguard {args.cmd} --help)", file=sys.stderr)
        return 2
    return handler(args)
