"""The arguments of `gpuguard xid scan`, apart from the command itself so that building the full command line does
not import the scanner."""

from __future__ import annotations

import argparse

from gpuguard.util.cliargs import add_config_option

HELP = "find Xid events in a kernel log file (dmesg, journalctl -k, syslog, kmsg) and the verdict on them"


def add_arguments(p: argparse.ArgumentParser, top_level: bool = False) -> None:
    add_config_option(p, "config file: its xid.overrides and policy apply (default: the shipped catalog)", top_level)
    p.add_argument("--file", required=True, help="log file ('-' for stdin)")
    p.add_argument("--json", action="store_true")
