"""argparse glue for `gpuguard monitor` (the per-job sidecar). Nothing heavy is imported here."""

from __future__ import annotations

import argparse
from typing import Any
from gpuguard.util.cliargs import add_config_option


def add_parser(sub: Any) -> None:
    p = sub.add_parser("monitor", help="per-node job sidecar: GPU/node sampling, stragglers, hangs")
    add_config_option(p)
    p.add_argument("--job-dir", required=True, help="the job's shared directory (same path on every node)")
    p.add_argument("--interval", type=float, help="seconds between samples (default monitor.interval_s, 10)")
    p.add_argument("--node", help="node name (default $SLURMD_NODENAME or the host name)")
    p.add_argument("--job-id", help="job id (default $SLURM_JOB_ID)")
    p.add_argument("--gpus", help="only these GPU indices, e.g. 0-3 (default: every GPU NVML shows the step)")
    p.add_argument("--train-log", help="training log to follow for progress (default monitor.train_log)")
    p.add_argument("--once", action="store_true", help="take one sample, evaluate, print it as JSON and exit")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: until killed)")



def run(args: argparse.Namespace) -> int:
    # here, not at the top: the full `gpuguard --help` parser imports every command's module, this one stays light
    from gpuguard.monitor.loop import main_from_args

    return main_from_args(args)
