"""`gpuguard efa parse-fi-info FILE [--json]`: count EFA devices in `fi_info -p efa` output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpuguard.nccl.cli_common import read_input
from gpuguard.probes.fabric import parse_fi_info
from gpuguard.util.cliargs import add_config_option


def add_parser(sub: Any) -> None:
    p = sub.add_parser("efa", help="EFA tools")
    es = p.add_subparsers(dest="efa_cmd", metavar="SUBCOMMAND")
    s = es.add_parser("parse-fi-info", help="count EFA devices in `fi_info -p efa` output")
    add_config_option(s)
    s.add_argument("file", help="output file ('-' for stdin)")
    s.add_argument("--json", action="store_true")


def cmd_efa_parse(args: argparse.Namespace) -> int:
    info = parse_fi_info(read_input(args.file))
    out = {"devices": info.devices, "domains": info.domains, "provider_found": info.provider_found,
           "error": info.error}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.file}: {info.devices} EFA device(s)" + (f": {', '.join(info.domains)}" if info.domains else ""))
        if info.error:
            print(f"  error: {info.error}")
    return 0 if info.provider_found else 1


def run(args: argparse.Namespace) -> int:
    if args.efa_cmd != "parse-fi-info":
        print("usage: gpuguard efa parse-fi-info FILE", file=sys.stderr)
        return 2
    return cmd_efa_parse(args)
