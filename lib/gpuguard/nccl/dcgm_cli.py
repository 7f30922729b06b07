"""`gpuguard dcgm parse FILE [--json]`: per-test, per-GPU results of `dcgmi diag -j`, or of its table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpuguard.nccl.cli_common import read_input
from gpuguard.probes.dcgm import SEVERITY_NAMES, DcgmParseError, parse_dcgm_diag
from gpuguard.util.cliargs import add_config_option


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dcgm", help="DCGM tools")
    ds = p.add_subparsers(dest="dcgm_cmd", metavar="SUBCOMMAND")
    s = ds.add_parser("parse", help="per-test, per-GPU results of `dcgmi diag -j` output or of the table "
                                    "`dcgmi diag` prints without -j")
    add_config_option(s)
    s.add_argument("file", help="output file ('-' for stdin)")
    s.add_argument("--json", action="store_true")


def cmd_dcgm_parse(args: argparse.Namespace) -> int:
    try:
        obs = parse_dcgm_diag(read_input(args.file))
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


def run(args: argparse.Namespace) -> int:
    if args.dcgm_cmd != "parse":
        print("usage: gpuguard dcgm parse FILE", file=sys.stderr)
        return 2
    return cmd_dcgm_parse(args)
