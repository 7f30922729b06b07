"""`gpuguard xid scan --file PATH`: the Xid events in a kernel log and the verdict the health check reaches on them.

Every event is read by the health check's own Xid check (`gpuguard.checks.xid`: catalog entry, the driver's
Fatal/Nonfatal token for NVLink5 Xids 144-150, Xid 154's recovery action, unknown codes warn) and the findings go
through the same policy (`gpuguard.pipeline.policy.decide`); lines forged from userspace are rejected by the same parser.
Exit 1 when that verdict drains, 0 when it does not, 2 on bad input. `gpuguard.cli.main.main` hands `xid scan` straight
to `main` here, so the command loads only what it needs (no other feature module, no YAML without --config).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from gpuguard.checks import get_check
from gpuguard.checks.xid import judge_kernel_log, xid_info
from gpuguard.kernellog import scanargs
from gpuguard.kernellog.bulk import scan_file
from gpuguard.kernellog.scan import ScanResult, observation
from gpuguard.model import Finding
from gpuguard.pipeline.policy import Verdict, decide
from gpuguard.xid.catalog import XidCatalog, load_catalog

CONTEXT = "scan"


def _site(config: Optional[str]) -> tuple[XidCatalog, str]:
    """The Xid catalog and policy.on_failure the hooks use: the site's, when a config is named."""
    if not config:
        return load_catalog(), "drain"
    from gpuguard.config.schema import ConfigError
    from gpuguard.siteconfig import load_config  # YAML only when a config is named

    try:
        cfg = load_config(config)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    overrides = cfg.xid.overrides or None
    return load_catalog(overrides=overrides), cfg.policy.on_failure


def _event_rows(res: ScanResult, catalog: XidCatalog) -> list[dict[str, Any]]:
    rows = []
    for ev in res.events:
        info = xid_info(ev, catalog)
        rows.append({"code": ev.code, "pci": ev.pci, "fatal": info.severity == "fatal", "severity": info.severity,
                     "name": info.name, "action": info.action, "pid": ev.pid, "process": ev.process_name,
                     "timestamp": ev.timestamp, "detail": ev.detail})
    return rows


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def _print_text(rows: list[dict[str, Any]], res: ScanResult, findings: list[Finding], verdict: Verdict) -> None:
    for e in rows:
        print(f"Xid {e['code']:>3} {'FATAL' if e['fatal'] else e['severity']:<6} {e['pci']}  {e['name']}"
              f"  ({e['timestamp'] or '-'})")
    print(f"{len(rows)} Xid events ({sum(e['fatal'] for e in rows)} fatal) in {_size(res.bytes_scanned)}; "
          f"{res.malformed} malformed, {res.rejected_non_kernel} not from the kernel")
    for f in findings:
        if f.severity.value != "ok":
            print(f"  {f.severity.value.upper()}: {f.message}")
    print(f"verdict: {verdict.outcome}" + (f" ({verdict.reason})" if verdict.reason else ""))


def _verdict_json(v: Verdict) -> dict[str, Any]:
    return {"outcome": v.outcome, "action": v.action.value, "reason": v.reason}


def run(args: argparse.Namespace) -> int:
    catalog, on_failure = _site(args.config)
    path = "/dev/stdin" if args.file == "-" else args.file
    try:
        res = scan_file(path)
    except OSError as e:  # exit 1 means "would drain": a file that cannot be read is a usage error
        print(f"gpuguard: error: cannot read {args.file}: {e.strerror or e}", file=sys.stderr)
        return 2
    findings = judge_kernel_log(observation(res, f"file:{args.file}", None), catalog, spec=get_check("gpu.xid"),
                                kind=CONTEXT)
    verdict = decide(findings, CONTEXT, on_failure=on_failure)
    rows = _event_rows(res, catalog)
    if args.json:
        print(json.dumps({"events": rows, "bytes": res.bytes_scanned, "malformed": res.malformed,
                          "rejected_non_kernel": res.rejected_non_kernel, "events_dropped": res.events_dropped,
                          "findings": [f.to_dict() for f in findings], "verdict": _verdict_json(verdict)}, indent=2))
    else:
        _print_text(rows, res, findings, verdict)
    return 1 if verdict.outcome == "drain" else 0


def main(argv: Sequence[str]) -> int:
    """`argv` after `xid scan`."""
    p = argparse.ArgumentParser(prog="gpuguard xid scan", description=scanargs.HELP)
    scanargs.add_arguments(p, top_level=True)
    args = p.parse_args(list(argv))
    try:
        return run(args)
    except ValueError as e:  # a config or Xid override that does not validate
        print(f"gpuguard: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gpuguard xid scan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
