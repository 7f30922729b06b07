"""`gpuguard job-attempt {begin,end,fabric}`: what rendered batch scripts call at each attempt's start and end
(gpuguard.templates.jobattempt) and to wait for the fabric. Its own module so that each attempt's bookkeeping
imports no Jinja, no renderer and no linter."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from gpuguard.siteconfig import load_config
from gpuguard.slurm.hostlist import HostlistError, expand_hostlist
from gpuguard.templates import jobattempt as ja
from gpuguard.templates.fabric import run_check
from gpuguard.templates.jobfiles import attempt_dir
from gpuguard.util.cliargs import add_config_option


def add_parser(sub: Any) -> None:
    p = sub.add_parser("job-attempt", help="(called by rendered batch scripts) record an attempt, requeue, resume, "
                                          "check the fabric")
    add_config_option(p)
    js = p.add_subparsers(dest="attempt_cmd", metavar="SUBCOMMAND")
    for name in ("begin", "end", "fabric"):
        s = js.add_parser(name)
        add_config_option(s)
        s.add_argument("--job-dir", required=True)
        s.add_argument("--attempt", type=int, required=True)
        if name in ("begin", "end"):
            s.add_argument("--checkpoint-dir")
            s.add_argument("--checkpoint-kind", default="glob", choices=("glob", "megatron", "latest"))
            s.add_argument("--checkpoint-glob", default="*")
            s.add_argument("--checkpoint-marker")
        if name == "end":
            s.add_argument("--exit-code", type=int, required=True)
            s.add_argument("--event", default="none", choices=("none", "timelimit", "stop", "term", "preflight"))
            s.add_argument("--blamed", default="",
                           help="hostlist of the nodes gpuguard preflight blamed: with event preflight they are excluded "
                                "on requeue; otherwise (min_nodes) the attempt trained without them")
            s.add_argument("--max-failures", type=int, default=None,
                           help="failed attempts requeued in a row (reset when the checkpoint advances)")
            s.add_argument("--max-requeues", type=int, default=None,
                           help="old name of --max-failures (scripts rendered before the budgets were split)")
            s.add_argument("--max-continuations", type=int, default=50, help="time-limit/preemption requeues")
            s.add_argument("--keep-excluded", action="append", default=[],
                           help="nodes the job itself excludes (kept on every requeue)")
            s.add_argument("--no-retry-exit-code", type=int, action="append", default=[])
            s.add_argument("--no-retry-pattern", action="append", default=[])
            s.add_argument("--if-requeued", action="store_true",
                           help="only if Slurm already requeued the job (else print 'running 0' and record nothing)")
        if name == "fabric":
            s.add_argument("--expect", required=True, choices=("efa", "ib"))
            s.add_argument("--ranks", type=int, required=True)
            s.add_argument("--wait", type=float, default=900.0)
            s.add_argument("--poll", type=float, default=5.0)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except Exception as e:  # noqa: BLE001 - a broken config must not stop the bookkeeping
        print(f"gpuguard job-attempt: config not usable ({e}); using defaults", file=sys.stderr)
        cfg = None
    job_dir = Path(args.job_dir)
    if args.attempt_cmd == "fabric":
        run_check(attempt_dir(job_dir, args.attempt) / "nccl", args.expect, args.ranks, args.wait, args.poll)
        return 0
    ctx = ja.JobContext.from_env(os.environ, cfg)
    if args.attempt_cmd == "begin":
        print(ja.begin(ctx, job_dir, args.attempt, args.checkpoint_dir, args.checkpoint_kind, args.checkpoint_glob,
                       args.checkpoint_marker))
        return 0
    if args.attempt_cmd == "end":
        ja.ignore_term()
        if args.if_requeued and not ja.slurm_requeued(ctx):
            print("running 0")
            return 0
        for p in args.no_retry_pattern:
            re.compile(p)
        max_failures = args.max_failures if args.max_failures is not None else \
            (args.max_requeues if args.max_requeues is not None else 3)
        d = ja.end(ctx, job_dir, args.attempt, args.exit_code, args.event,
                   ja.policy_from_args(max_failures, args.no_retry_exit_code, args.no_retry_pattern,
                                       args.max_continuations),
                   ja.CheckpointSpec(args.checkpoint_dir, args.checkpoint_kind, args.checkpoint_glob,
                                     args.checkpoint_marker),
                   keep_excluded=args.keep_excluded, blamed=blamed_nodes(args.blamed))
        ja.notify_outcome(cfg, ctx, job_dir, args.attempt, d)
        print(f"gpuguard: attempt {args.attempt}: {d.reason}: {d.detail} -> {d.action}"
              + (f" (excluding {','.join(d.exclude)})" if d.exclude else ""), file=sys.stderr)
        print(f"{d.action} {d.exit_code}")
        return 0
    print("usage: gpuguard job-attempt {begin,end,fabric} ...", file=sys.stderr)
    return 2


def blamed_nodes(hostlist: str) -> list[str]:
    """--blamed: the pre-flight's hostlist (its exclude file); an unreadable one excludes nothing."""
    try:
        return expand_hostlist(hostlist.strip()) if hostlist.strip() else []
    except HostlistError:
        print(f"gpuguard job-attempt: --blamed {hostlist!r} is not a hostlist; excluding nothing", file=sys.stderr)
        return []
