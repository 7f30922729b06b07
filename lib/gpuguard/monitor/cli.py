"""argparse glue for `gpuguard monitor | trainlog | status | history`. Imports are lazy: `gpuguard.cli` imports
this module whenever it builds its full parser, so nothing heavy is imported here."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("monitor", help="per-node job sidecar: GPU/node sampling, stragglers, hangs")
    p.add_argument("--config", help="config file (default $GPUGUARD_CONFIG or /etc/gpuguard/config.yaml)")
    p.add_argument("--job-dir", required=True, help="the job's shared directory (same path on every node)")
    p.add_argument("--interval", type=float, help="seconds between samples (default monitor.interval_s, 10)")
    p.add_argument("--node", help="node name (default $SLURMD_NODENAME or the host name)")
    p.add_argument("--job-id", help="job id (default $SLURM_JOB_ID)")
    p.add_argument("--gpus", help="only these GPU indices, e.g. 0-3 (default: every GPU NVML shows the step)")
    p.add_argument("--train-log", help="training log to follow for progress (default monitor.train_log)")
    p.add_argument("--once", action="store_true", help="take one sample, evaluate, print it as JSON and exit")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: until killed)")

    p = sub.add_parser("trainlog", help="analyse a training log (Megatron, nanotron, torchtitan, HF Trainer, "
                       "Lightning): NaN/missing loss, skipped steps, grad-norm spikes, throughput drops, lr")
    p.add_argument("file", help="log file ('-' for stdin)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="PNG", help="also draw loss, lr, grad norm and time per sample on one "
                   "iteration axis, restarts and skipped intervals marked (needs matplotlib)")
    p.add_argument("--grad-spike-k", type=float,
                   help="flag grad norm above the run's median + K x MAD of its trailing window (default 6)")
    p.add_argument("--grad-norm-max", type=float, help="also flag grad norm above this absolute value (default off)")
    p.add_argument("--spike-ratio", type=float, help="flag loss above this multiple of its recent trend (default 1.3)")
    p.add_argument("--throughput-drop", type=float, help="flag time per sample (token, iteration) staying this "
                   "fraction slower than before for 5+ records (default 0.2)")
    p.add_argument("--time-spike-ratio", type=float, help=argparse.SUPPRESS)  # old name: drop = 1 - 1/ratio

    p = sub.add_parser("status", help="nodes drained by gpuguard, grouped by fault: hostlists, drained for, last "
                                      "health check, undelivered notifications")
    p.add_argument("--config", help="config file")
    p.add_argument("--all", action="store_true", help="also list nodes drained or down by someone else")
    p.add_argument("--details", action="store_true", help="every drained node, not only the summary (shown "
                   "without asking for up to 20 nodes)")
    p.add_argument("--node", help="only these nodes, with their details: a Slurm hostlist, e.g. gpu-[0100-0163]")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("history", help="drains, findings, runs and requeues from the history store")
    from gpuguard.history import add_arguments as add_history_arguments  # filters shared with `fleet history`

    add_history_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.cmd == "monitor":
        from gpuguard.monitor.loop import main_from_args

        return main_from_args(args)
    if args.cmd == "trainlog":
        from gpuguard.trainlog import main_from_args as trainlog_main

        return trainlog_main(args)
    if args.cmd == "status":
        from gpuguard.status import cmd_status

        return cmd_status(args)
    if args.cmd == "history":
        from gpuguard import history

        return history.cmd_history(args)
    return 2
