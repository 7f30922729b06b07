"""`gpuguard watch`: a daemon that follows the kernel log and drains the node within a second of a fatal Xid.

    follower (kernellog source) --lines--> judge (gpu.xid + policy) --events--> DrainWorker thread --> Slurm, store
         ^                                                                         |
         +------------------- cursor: only past what is judged and acted on <------+

- The main thread only reads and judges (gpuguard.watch.loop). Everything that can be slow (scontrol, SQLite,
  notifications) happens in one worker thread fed by a queue (gpuguard.watch.worker), so a hung slurmctld never
  stops the log from being followed.
- A fatal Xid drains through `gpuguard.slurm.client.drain_node` (ownership rules: a node drained, down or in
  maintenance by someone else is never touched) with the prolog's reason shape and `[watch <action>]`.
  A failed attempt is retried with exponential back-off until it resolves (done / already / foreign).
- The cursor (`watch:<node>` in the store) only moves past a fatal Xid once its drain resolved: a restart
  re-judges an Xid whose drain never happened, and never re-drains for one that was acted on.
- SIGTERM/SIGINT stop cleanly (exit 0), SIGHUP reloads the config (as does an edit of the file, within ~10 s).
  With $NOTIFY_SOCKET (systemd Type=notify) it reports READY/STOPPING and pings the watchdog
  (gpuguard.watch.systemd).

This module is the entry point: `gpuguard watch` and `python -m gpuguard.watch.daemon` (what the systemd unit
runs). The settings come from gpuguard.watch.settings.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Optional

from gpuguard.config.schema import Config, ConfigError
from gpuguard.siteconfig import load_config
from gpuguard.context import context_from_env
from gpuguard.util.cliargs import add_config_option
from gpuguard.watch.loop import WatchDaemon


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("watch", help="daemon: follow the kernel log, drain within a second of a fatal Xid")
    _add_arguments(p)


def _add_arguments(p: argparse.ArgumentParser, top_level: bool = False) -> None:
    add_config_option(p, top_level=top_level)
    p.add_argument("--node", help="Slurm node name (default: node.name, $SLURMD_NODENAME, the short hostname)")
    p.add_argument("--source", help="kernel log to follow: auto | kmsg[:PATH] | journal[:JOURNALCTL] | file:PATH "
                   "(default: watch.source, else sources.kernel_log)")
    p.add_argument("--once", action="store_true",
                   help="judge what is new since the cursor, drain if needed, and exit (1 if a drain failed)")
    p.add_argument("--agent", action="store_true",
                   help="also keep the node agent that runs the slurmd hooks without their start-up cost (docs/agent.md)")


_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def node_name(cfg: Config, explicit: Optional[str]) -> str:
    """--node, node.name, $SLURMD_NODENAME or the short hostname. It names the store file and goes to scontrol,
    so anything but a plain node name is refused."""
    name = context_from_env("manual", os.environ, node=explicit or cfg.node.name).node
    if not _NODE_NAME.match(name):
        raise ValueError(f"invalid node name {name!r} (letters, digits, '.', '_' and '-' only)")
    return name


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)  # ConfigError: the CLI prints it and exits 2
    daemon = WatchDaemon(cfg, node=node_name(cfg, args.node), config_path=args.config, source=args.source,
                         once=args.once, agent=args.agent)
    daemon.install_signal_handlers()
    return daemon.run()


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m gpuguard.watch.daemon`: what the systemd unit runs. Same as `gpuguard watch`, without building the full
    command line (so no other feature module, broken or slow to import, can keep the node's guard from starting)."""
    ap = argparse.ArgumentParser(prog="gpuguard watch", description=__doc__.splitlines()[0] if __doc__ else None)
    _add_arguments(ap, top_level=True)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (ConfigError, ValueError) as e:
        print(f"gpuguard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
