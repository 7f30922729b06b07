"""`gpuguard preflight`: inside an allocation (the batch script, once), test the fabric between the job's nodes and
say in one line what was tested, how long it took and what was blamed (docs/nccl.md).

Exit codes: 0 go on (passed, or nothing reproducible), 10 something was blamed (the nodes to go on without are in
`--exclude-file` and in the `GPUGUARD_PREFLIGHT_EXCLUDE=` line), 2 usage. `--record-drain` is the step it runs on a
blamed node (`srun -w NODE`) to make the drain a standing condition there (gpuguard.preflight.record)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Optional

from gpuguard.siteconfig import load_config
from gpuguard.nccl.cli_common import profile_of, sweep_spec
from gpuguard.preflight.blame import Blame, run_blame
from gpuguard.preflight.floor import largest_size, pass_sample, preflight_floor
from gpuguard.preflight.history import load_proposals, record_sample
from gpuguard.preflight.judge import summary_line
from gpuguard.preflight.ncclenv import preflight_preset_env
from gpuguard.preflight.nccltests import BACKEND, NcclTestsRounds
from gpuguard.preflight.pool import WorkerPool
from gpuguard.preflight.runner import PoolMeasure
from gpuguard.preflight.topology import job_switches, parse_topology
from gpuguard.slurm.hostlist import HostlistError, compress_hostlist, expand_hostlist
from gpuguard.slurm.parse import parse_node_lines
from gpuguard.util.fs import atomic_write
from gpuguard.util.toolrun import run_tool

BLAMED_EXIT = 10
STARTUP_SHARE = 0.6
PAGE_BUDGET_S = 10.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("preflight", help="inside an allocation: test the fabric between the job's nodes, blame "
                                         "and drain a bad node or switch")
    p.add_argument("--nodes", help="hostlist (default: $SLURM_JOB_NODELIST)")
    p.add_argument("--budget", type=float, help="seconds for everything (default nccl.preflight_budget_s)")
    p.add_argument("--floor", type=float, help="GB/s the largest size must reach (default nccl.preflight_busbw_*)")
    p.add_argument("--no-drain", action="store_true", help="blame and exclude, drain nothing")
    p.add_argument("--exclude-file", help="write the nodes to go on without here (one hostlist line)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--record-drain", metavar="REASON", help=argparse.SUPPRESS)
    p.add_argument("--evidence", default="{}", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(getattr(args, "config", None))
    if args.record_drain:
        return record_here(cfg, args.record_drain, args.evidence)
    try:
        nodes = expand_hostlist(args.nodes or os.environ.get("SLURM_JOB_NODELIST", ""))
    except HostlistError as e:
        print(f"gpuguard preflight: {e}", file=sys.stderr)
        return 2
    if len(nodes) < 2:
        print(f"gpuguard preflight: {len(nodes)} node(s): nothing between nodes to test")
        return 0
    n = cfg.nccl
    budget = args.budget if args.budget is not None else n.preflight_budget_s
    start = time.monotonic()
    profile = profile_of(cfg, None)
    proposals, unread = load_proposals(cfg, profile)
    # the rounds end by `start + budget - reserve`: time left to stop late collectives and drain what was blamed.
    # The workers' start-up (torch's import) may take up to STARTUP_SHARE of the rest; the rounds share what remains
    reserve = min(5.0, budget * 0.15)
    backend = n.preflight_backend
    preset = preflight_preset_env(n.sweep_preset, profile, cfg.templates.presets, os.environ) \
        if backend == BACKEND else None
    pool = round_runner(n, nodes, backend, preset.env if preset else {})
    try:
        if isinstance(pool, WorkerPool):
            pool.wait_up(start + (budget - reserve) * STARTUP_SHARE)
        up_s = max((w.up_s for w in pool.workers.values() if w.up_s is not None), default=None)
        if backend == "auto":
            cuda = [w.cuda for w in pool.workers.values() if w.sock is not None]
            backend = "nccl" if cuda and all(cuda) else "gloo"
        # the floor of this backend's samples only (known once the workers said whether they have GPUs)
        floor = preflight_floor(args.floor if args.floor is not None else n.preflight_busbw_gbps,
                                {} if args.floor is not None else n.preflight_busbw_by_nodes, proposals, profile,
                                largest_size(n.preflight_min_bytes, n.preflight_max_bytes), backend,
                                "--floor" if args.floor is not None else "config")
        measure = PoolMeasure(pool, floor.resolve, start + budget - reserve, backend=backend,
                              min_bytes=n.preflight_min_bytes, max_bytes=n.preflight_max_bytes,
                              iters=n.preflight_iterations, step_cap_s=max(3.0, (budget - reserve) / 2))
        switches = job_switches(read_topology(), nodes)
        blame = run_blame(nodes, measure, switches or None)
    finally:
        pool.close()
    acted = act(cfg, blame, n.preflight_drain and not args.no_drain, getattr(args, "config", None))
    sample = pass_sample(blame.outcome, nodes, profile, os.environ.get("SLURM_JOB_ID"), backend)
    said = [floor.describe(len(nodes))] + ([preset.note] if preset else []) + ([unread] if unread else []) + \
        ([record_sample(cfg, sample)] if sample else [])
    line = summary_line(nodes, time.monotonic() - start, blame.outcome.conclusion, blame.blamed, blame.what,
                        up_s, measure.rounds, said)
    print(line + (f"; {acted}" if acted else ""), flush=True)
    if blame.exclude:
        print(f"GPUGUARD_PREFLIGHT_EXCLUDE={compress_hostlist(blame.exclude)}", flush=True)
        if args.exclude_file:
            atomic_write(args.exclude_file, compress_hostlist(blame.exclude) + "\n")
    if args.json:
        print(json.dumps({**blame.outcome.to_dict(), "switch": blame.switch, "exclude": blame.exclude,
                          "drain": blame.nodes_to_drain}, default=str))
    return BLAMED_EXIT if blame.exclude else 0


def round_runner(n: Any, nodes: list[str], backend: str, env: Optional[dict[str, str]] = None
                 ) -> "WorkerPool | NcclTestsRounds":
    """nccl-tests: each round an srun step of the sweep's all_reduce_perf per group (no workers), its ranks with
    `env` added (the NCCL preset); else one persistent torch worker per node."""
    if backend == BACKEND:
        return NcclTestsRounds(nodes, sweep_spec(n), env=dict(env or {}))
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    addrs = node_addrs(nodes)
    return WorkerPool(nodes, here, {**addrs, here: addrs.get(here) or local_addr(addrs.get(nodes[0], nodes[0]))})


def node_addrs(nodes: list[str]) -> dict[str, str]:
    """node -> NodeAddr (what its peers reach it at; its own name may resolve to 127.0.1.1 on itself)."""
    r = run_tool(["scontrol", "show", "node", "-o", ",".join(nodes)], 10.0)
    info = parse_node_lines(r.text()) if r.ok else {}
    return {name: d.get("NodeAddr") or name for name, d in info.items()}


def local_addr(peer: str) -> str:
    """This machine's address towards `peer` (a connected UDP socket sends nothing): what the workers dial back."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def read_topology() -> dict[str, list[str]]:
    r = run_tool(["scontrol", "show", "topology"], 10.0)
    return parse_topology(r.text()) if r.ok else {}


def act(cfg: Any, blame: Blame, drain: bool, config: Optional[str]) -> str:
    """Drain each blamed node on the node itself (a standing condition there), or page once for a switch."""
    if blame.switch:
        return page_switch(cfg, blame)
    if not drain:
        return "not drained (--no-drain / nccl.preflight_drain)" if blame.nodes_to_drain else ""
    done = []
    for node, reason in blame.nodes_to_drain.items():
        v = blame.outcome.verdicts[node]
        ev = json.dumps({"busbw_gbps": v.busbw_gbps or 0.0, "source": "preflight"})
        argv = ["srun", "--overlap", "-N1", "-n1", "-w", node, "--quiet", sys.executable, "-m", "gpuguard",
                *(["--config", config] if config else []),
                "preflight", "--record-drain", reason, "--evidence", ev]
        r = run_tool(argv, 15.0)
        done.append(f"{node} drained" if r.ok else f"{node} {direct_drain(cfg, node, reason)}")
    return ", ".join(done)


def direct_drain(cfg: Any, node: str, reason: str) -> str:
    """The node cannot run the step (its link is down): drain it from here; its own hooks are not told."""
    from gpuguard.slurm.client import client_from_config, drain_node

    out = drain_node(client_from_config(cfg.slurm, cfg.deadlines.scontrol_s), node, reason)
    return f"unreachable, drained from here: {out.outcome}"


def page_switch(cfg: Any, blame: Blame) -> str:
    from gpuguard.notify.api import emit, flush
    from gpuguard.notify.event import Event

    members = compress_hostlist(blame.exclude)
    reporter = os.environ.get("SLURMD_NODENAME") or cfg.node.name
    msg = f"gpuguard: NETWORK switch {blame.switch}: its nodes {members} slow together in a job pre-flight"
    # the page is about the switch (labels component/component_kind/switch, as the storm guard's shared-part page),
    # sent by the node that ran the pre-flight: its spool is that node's, which its own hooks also flush later
    ev = Event(kind="network", node=reporter, message=msg, severity="critical", check_id="fabric.nccl",
               job_id=os.environ.get("SLURM_JOB_ID"), evidence={"switch": blame.switch, "nodes": members},
               component=str(blame.switch), component_kind="switch",
               dedup_key=f"gpuguard-switch-{blame.switch}")
    # a page's first delivery imports apprise (seconds on a busy node): a budget of its own, then one retry of the
    # spool
    said = emit(cfg, ev, budget_s=PAGE_BUDGET_S)
    if said == "spooled" and flush(cfg, budget_s=PAGE_BUDGET_S, node=reporter) > 0:
        said = "sent"
    return f"page: {said}"


def record_here(cfg: Any, reason: str, evidence_json: str) -> int:
    from gpuguard.preflight.record import record_drain

    node = os.environ.get("SLURMD_NODENAME") or cfg.node.name
    try:
        evidence = json.loads(evidence_json)
    except ValueError:
        evidence = {}
    out = record_drain(cfg, node, reason, reason.split(": ", 2)[-1], evidence if isinstance(evidence, dict) else {})
    print(f"gpuguard preflight: {node}: {out['outcome']}: {out['detail']}")
    return 0 if out["outcome"] in ("done", "already", "pending") else 1
