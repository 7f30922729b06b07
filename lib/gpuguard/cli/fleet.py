"""`gpuguard fleet init-db | ship | prune | history | report`. psycopg is imported only where PostgreSQL is
talked to (gpuguard.fleet.pg), so building every feature's parser for `--help` never loads it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import hostlist

from gpuguard.cli.history import (add_arguments as add_history_arguments, filters_from_args, output_format,
                                  requeue_source, write_history)
from gpuguard.siteconfig import load_config
from gpuguard.fleet.partitions import ensure_partitions, prune
from gpuguard.fleet.pg import FleetDBError, clean_error, connect
from gpuguard.fleet.pgsource import PgHistory
from gpuguard.store.filters import build_filters
from gpuguard.fleet.report import format_report, report_pg, report_sqlite
from gpuguard.fleet.schema import ensure_schema
from gpuguard.fleet.ship import ConnectionKeeper, ship_path
from gpuguard.fleet.url import redact_url
from gpuguard.store.history_sqlite import SqliteHistory, store_paths
from gpuguard.util.cliargs import add_config_option
from gpuguard.util.timefmt import iso_utc


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fleet", help="central history in PostgreSQL (store.url): init-db, ship, prune, history, "
                                     "report")
    fs = p.add_subparsers(dest="fleet_cmd", metavar="SUBCOMMAND")

    s = fs.add_parser("init-db", help="create or upgrade the gpuguard schema in store.url's database (as its owner)")
    add_config_option(s)
    s.add_argument("--timeout-s", type=float, default=3600.0,
                   help="longest an upgrade may take (it copies every row of an older schema; default 3600)")

    s = fs.add_parser("prune", help="retention: drop months older than store.fleet_retention_days, create the "
                                    "months ahead (as the database owner; e.g. a daily timer on one host)")
    add_config_option(s)
    s.add_argument("--json", action="store_true")

    s = fs.add_parser("ship", help="send what the local store(s) recorded to store.url (for a systemd timer)")
    add_config_option(s)
    s.add_argument("--node", help="only these nodes' stores (a hostlist; when store.path has {node})")
    s.add_argument("--budget-s", type=float, default=120.0, help="stop after this long (default 120)")
    s.add_argument("--json", action="store_true")

    s = fs.add_parser("history", help="drains, findings and runs of the whole fleet (store.url; else local stores)")
    add_history_arguments(s, default_since="24h")
    s.add_argument("--local", action="store_true", help="read the local SQLite store(s) even when store.url is set")

    s = fs.add_parser("report", help="drains per check per week, MTBF, flapping nodes, time drained per node")
    add_config_option(s)
    s.add_argument("--node", help="only these nodes: a Slurm hostlist")
    s.add_argument("--since", default="28d", help="window start: 7d, 4w, or an ISO 8601 time (default 28d)")
    s.add_argument("--until", help="window end (default now)")
    s.add_argument("--check", action="append", metavar="ID", help="only drains by this check (repeatable)")
    s.add_argument("--keyword", action="append", metavar="KW", help="only drains with this keyword (XID = any Xid)")
    s.add_argument("--flap-min", type=int, default=3, help="failures in the window that make a node flapping (3)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--local", action="store_true", help="report over the local SQLite store(s) even with store.url")


def _url(cfg: Any) -> Any:
    return cfg.store.url


def _need_url(cfg: Any, what: str) -> str:
    url = _url(cfg)
    if not url:
        raise ValueError(f"{what} needs store.url (postgresql://USER@HOST/DB) in {cfg.source}")
    return str(url)


def cmd_init_db(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    url = _need_url(cfg, "gpuguard fleet init-db")
    try:
        conn = connect(url, timeout_s=10.0, statement_timeout_s=max(30.0, args.timeout_s),
                       application_name="gpuguard-init-db")
    except FleetDBError as e:
        print(f"gpuguard fleet init-db: {e}", file=sys.stderr)
        return 1
    try:
        before, now = ensure_schema(conn, upgrade=True)
    except Exception as e:  # noqa: BLE001 - psycopg errors (permissions)
        print(f"gpuguard fleet init-db: {redact_url(url)}: {clean_error(e, url)}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    print(f"{redact_url(url)}: gpuguard schema " + (f"at version {now}" if before == now
                                                    else f"migrated from version {before} to {now}"))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    url = _need_url(cfg, "gpuguard fleet prune")
    days = cfg.store.fleet_retention_days
    try:
        conn = _open_pg(cfg, statement_timeout_s=300.0)
    except FleetDBError as e:
        print(f"gpuguard fleet prune: {e}", file=sys.stderr)
        return 1
    try:
        if days:
            done = prune(conn, float(days))
        else:
            done = {"cutoff": None, "dropped": [], "deleted": {}, "created": ensure_partitions(conn)}
    except Exception as e:  # noqa: BLE001 - psycopg errors: not the owner, lock timeout
        print(f"gpuguard fleet prune: {redact_url(url)}: {clean_error(e, url)}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    if args.json:
        print(json.dumps({**done, "cutoff": iso_utc(done["cutoff"])}, indent=2))
        return 0
    kept = f"rows before {iso_utc(done['cutoff'])}" if done["cutoff"] else "nothing (store.fleet_retention_days: null)"
    deleted = ", ".join(f"{n} {t}" for t, n in done["deleted"].items() if n) or "none"
    print(f"{redact_url(url)}: pruned {kept}: dropped {len(done['dropped'])} month partition(s) "
          f"{' '.join(done['dropped'])}".rstrip() + f"; deleted {deleted}; created {len(done['created'])} ahead")
    return 0


def cmd_ship(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    _need_url(cfg, "gpuguard fleet ship")
    nodes: list[str] = []
    if args.node:
        try:
            nodes = hostlist.expand_hostlist(args.node)
        except hostlist.BadHostlist as e:
            raise ValueError(f"--node: not a Slurm hostlist ({e}): {args.node!r}") from None
    if args.budget_s <= 0:
        raise ValueError(f"--budget-s: expected a number > 0, got {args.budget_s}")
    paths = store_paths(cfg.store.path, nodes)
    if not paths:
        print(f"gpuguard fleet ship: no store file at {cfg.store.path}", file=sys.stderr)
        return 0
    until = time.monotonic() + args.budget_s
    results = []
    keeper = ConnectionKeeper()  # one connection for every store here
    try:
        for path in paths:
            left = until - time.monotonic()
            if left <= 0:
                break
            results.append(ship_path(cfg, path, left, keeper=keeper))
    finally:
        keeper.release()
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        for r in results:
            print(r.summary())
    return 0 if results and all(r.error is None for r in results) else 1


def _open_pg(cfg: Any, statement_timeout_s: float = 30.0) -> Any:
    return connect(_need_url(cfg, "gpuguard fleet"), timeout_s=10.0, statement_timeout_s=statement_timeout_s,
                   application_name="gpuguard-fleet")


def cmd_history(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    f = filters_from_args(args)
    if args.local or not _url(cfg):
        if not args.local:
            print("gpuguard fleet history: store.url not set: reading the local SQLite store(s)", file=sys.stderr)
        source: Any = SqliteHistory(store_paths(cfg.store.path, f.nodes))
        title = f"history ({len(source.conns)} local store file(s))"
    else:
        try:
            source = PgHistory(_open_pg(cfg), redact_url(cfg.store.url or ""))
        except FleetDBError as e:
            print(f"gpuguard fleet history: {e}", file=sys.stderr)
            return 1
        title = f"fleet history ({source.label[0]})"
    try:
        write_history(sys.stdout, output_format(args), source, requeue_source(cfg), f, args.limit or None, title)
    except Exception as e:  # noqa: BLE001 - psycopg errors: undefined table (no init-db yet), timeouts
        if type(e).__module__.startswith("psycopg"):
            hint = " (run `gpuguard fleet init-db`)" if "does not exist" in str(e) else ""
            print(f"\ngpuguard fleet history: {clean_error(e, cfg.store.url or '')}{hint}",
                  file=sys.stderr)
            return 1
        raise
    finally:
        source.close()
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.flap_min < 1:
        raise ValueError(f"--flap-min: expected a number >= 1, got {args.flap_min}")
    f = build_filters(since=args.since, until=args.until, node=args.node, check=args.check, keyword=args.keyword)
    if args.local or not _url(cfg):
        rep = report_sqlite(store_paths(cfg.store.path, f.nodes), f, args.flap_min)
    else:
        try:
            conn = _open_pg(cfg)
        except FleetDBError as e:
            print(f"gpuguard fleet report: {e}", file=sys.stderr)
            return 1
        try:
            rep = report_pg(conn, f, f"PostgreSQL {redact_url(cfg.store.url or '')}", args.flap_min)
        except Exception as e:  # noqa: BLE001
            hint = " (run `gpuguard fleet init-db`)" if "does not exist" in str(e) else ""
            print(f"gpuguard fleet report: {clean_error(e, cfg.store.url or '')}{hint}", file=sys.stderr)
            return 1
        finally:
            conn.close()
    from gpuguard.slurm.components import load_components  # the switches (and site parts) as they are now

    parts, problems = load_components(cfg.slurm, float(cfg.deadlines.scontrol_s))
    for p in problems:
        print(f"gpuguard fleet report: {p}", file=sys.stderr)
    rep.group_by(parts)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        sys.stdout.write(format_report(rep))
    return 0


def run(args: argparse.Namespace) -> int:
    handlers = {"init-db": cmd_init_db, "ship": cmd_ship, "prune": cmd_prune, "history": cmd_history,
                "report": cmd_report}
    handler = handlers.get(getattr(args, "fleet_cmd", None) or "")
    if handler is None:
        print("usage: gpuguard fleet {init-db,ship,prune,history,report} ...", file=sys.stderr)
        return 2
    return handler(args)
