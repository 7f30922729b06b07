#!/usr/bin/env python3
"""Central history at fleet scale: every `gpuguard fleet history` / `fleet report` form, timed through gpuguard's
own query code on a generated fleet (bench/fleet_data.py) in a real PostgreSQL server (Debian's, started in a temp
dir). Target: each form under 1 s at 10,000 nodes x 30 days.

A form is timed as the command does its work: every count and every listing of `fleet history` (the rows written
to /dev/null as JSON) or the three statements of `fleet report`, on one connection; the median of `--repeat` runs
after one warm-up (the first run is reported too) with its spread, the CPU the server spent on it (on a busy machine
the wall time also counts waiting for a core) and the load average before and after. Also printed: rows and bytes per table, and how
many runs the rows stand for.

    python bench/fleet_scale.py [--nodes 10000] [--days 30] [--repeat 3] [--shared-buffers 1GB]

bench/run.py calls `bench_fleet(nodes, days, row=row)`. tests/integration/test_fleet_pg.py uses `history_forms`,
`report_forms` and `plan_of` to check the plans on a smaller fleet.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT))  # devtools/
sys.path.insert(0, str(ROOT / "bench"))

from fleet_data import generate, sizes  # noqa: E402
from figures import Measuring, spread  # noqa: E402

from gpuguard.fleet.pgquery import drains_query, findings_query, healthy_runs_query, runs_query  # noqa: E402
from gpuguard.fleet.pgsource import PgHistory  # noqa: E402
from gpuguard.store.filters import Filters, build_filters  # noqa: E402
from gpuguard.fleet.report import report_pg  # noqa: E402
from gpuguard.cli.history import write_history  # noqa: E402

Row = Callable[..., None]  # (what, value, target, ok, load=...), as bench/figures.py's Table.row
TARGET_S = 1.0


def history_forms(nodes: int) -> list[tuple[str, dict[str, Any]]]:
    """`fleet history` as admins run it: (the flags, build_filters() arguments)."""
    some = f"gpu-[00001-{min(nodes, 100):05d}]"
    return [
        ("--since 24h", {"since": "24h"}),
        ("--since 30d", {"since": "30d"}),
        ("--keyword XID79 --since 30d", {"since": "30d", "keyword": ["XID79"]}),
        ("--keyword XID --since 30d", {"since": "30d", "keyword": ["XID"]}),
        ("--verdict drain --since 30d", {"since": "30d", "verdict": ["drain"]}),
        ("--verdict warn --since 7d", {"since": "7d", "verdict": ["warn"]}),
        ("--check gpu.ecc --since 30d", {"since": "30d", "check": ["gpu.ecc"]}),
        ("--gpu 3 --since 30d", {"since": "30d", "gpu": ["3"]}),
        (f"--node {some} --since 30d", {"since": "30d", "node": some}),
        ("--node gpu-00042 --since 30d", {"since": "30d", "node": "gpu-00042"}),
        ("--verdict pass --since 7d", {"since": "7d", "verdict": ["pass"]}),
    ]


def report_forms(nodes: int) -> list[tuple[str, dict[str, Any]]]:
    many = f"gpu-[00001-{min(nodes, 500):05d}]"
    return [
        ("report (--since 28d)", {"since": "28d"}),
        ("report --since 7d", {"since": "7d"}),
        ("report --keyword XID --since 28d", {"since": "28d", "keyword": ["XID"]}),
        (f"report --node {many}", {"since": "28d", "node": many}),
    ]


def history_statements(f: Filters, now: float) -> list[tuple[str, dict[str, Any]]]:
    """Every statement `fleet history` runs for these filters (counts and listings)."""
    out = []
    for build in (runs_query, findings_query, drains_query):
        for q in (build(f, None, count=True), build(f, 200)):
            out.append((q.sql, q.params))
    healthy = healthy_runs_query(f, now)
    if healthy is not None:
        out.append((healthy.sql, healthy.params))
    return out


def run_history(conn: Any, f: Filters, now: float) -> int:
    out = io.StringIO()
    source = PgHistory(conn, "bench", now=now)
    write_history(out, "json", source, None, f, 200, "fleet history")
    conn.rollback()
    return len(out.getvalue())


def run_report(conn: Any, f: Filters, now: float) -> int:
    rep = report_pg(conn, f, "bench", now=now)
    return len(rep.nodes)


def plan_of(conn: Any, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN (FORMAT JSON) of one statement with its parameters: the plan tree."""
    row = conn.execute("EXPLAIN (FORMAT JSON) " + sql, params).fetchone()
    conn.rollback()
    return row[0][0]["Plan"]


def server_cpu_s(data_dir: Path) -> float:
    """CPU seconds the PostgreSQL server has used so far: its processes, and the parallel workers it reaped. What
    a query costs whatever else the machine is doing (the wall time also counts waiting for a core)."""
    tick = os.sysconf("SC_CLK_TCK")
    pid = int((data_dir / "postmaster.pid").read_text().split()[0])
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(proc.name) == pid:
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        elif int(fields[1]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def timed(fn: Callable[[], Any], repeat: int, data_dir: Optional[Path] = None) -> tuple[float, list[float], float]:
    """(first run, the `repeat` runs after it, median server CPU of those) in seconds."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times, cpus = [], []
    for _ in range(repeat):
        c0 = server_cpu_s(data_dir) if data_dir else 0.0
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpus.append(server_cpu_s(data_dir) - c0 if data_dir else 0.0)
    return first, times, statistics.median(cpus)


def _print_row(what: str, value: str, target: str, ok: Optional[bool], **_: Any) -> None:
    verdict = "-" if ok is None else ("ok" if ok else "MISSED")
    print(f"  {what}: {value} (target {target}) {verdict}", flush=True)


def bench_fleet(nodes: int = 10000, days: int = 30, repeat: int = 3, shared_buffers: str = "1GB",
                row: Row = _print_row) -> None:
    from devtools.devpg import DevPostgres, missing_requirements
    from gpuguard.fleet.pg import connect
    from gpuguard.fleet.schema import ensure_schema

    missing = missing_requirements()
    if missing:
        print("  skipping the fleet benchmark: " + "; ".join(missing))
        return
    print(f"[fleet] central history, generated fleet: {nodes} nodes x {days} days (PostgreSQL, "
          f"shared_buffers={shared_buffers})", flush=True)
    with tempfile.TemporaryDirectory(prefix="gg-bench-fleet-"):
        server = DevPostgres(settings={"shared_buffers": shared_buffers, "work_mem": "32MB"}).start()
        try:
            conn = connect(server.url, statement_timeout_s=3600)
            ensure_schema(conn)
            t0 = time.monotonic()
            now, steps = generate(conn, nodes, days, log=print)
            row("generate the fleet (SQL)", f"{time.monotonic() - t0:.0f} s", "-", None)
            _report_sizes(conn, row)
            _time_forms(conn, nodes, now, repeat, server.data, row)
            conn.close()
        finally:
            server.destroy()


def _time_forms(conn: Any, nodes: int, now: float, repeat: int, data_dir: Path, row: Row) -> None:
    """Every form, one after another, each with its own load average before and after."""
    forms = [(f"fleet history {n}", kw, run_history) for n, kw in history_forms(nodes)]
    forms += [(f"fleet {n}", kw, run_report) for n, kw in report_forms(nodes)]
    for name, kw, fn in forms:
        f = build_filters(now=now, **kw)
        with Measuring(quiet=True) as load:
            first, times, cpu = timed(lambda: fn(conn, f, now), repeat, data_dir)
        row(name, f"{spread(times)} (first {first:.3f} s; server CPU {cpu:.2f} s)", f"< {TARGET_S:g} s",
            statistics.median(times) < TARGET_S, load=load)


def _report_sizes(conn: Any, row: Row) -> None:
    total = 0
    for table, s in sizes(conn).items():
        total += s["bytes"]
        row(f"central {table}", f"{s['rows']:,} rows for {s['stands_for']:,} records, {s['bytes'] / 2**20:.0f} MiB",
            "-", None)
    row("central history size", f"{total / 2**20:.0f} MiB", "-", None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shared-buffers", default="1GB")
    a = ap.parse_args()
    rows: list[tuple[str, str, str, Optional[bool]]] = []

    def row(what: str, value: str, target: str, ok: Optional[bool], **_: Any) -> None:
        rows.append((what, value, target, ok))
        _print_row(what, value, target, ok)

    bench_fleet(a.nodes, a.days, a.repeat, a.shared_buffers, row=row)
    print("\n| measurement | value | target | |\n|---|---|---|---|")
    for what, value, target, ok in rows:
        print(f"| {what} | {value} | {target} | {'-' if ok is None else 'ok' if ok else 'MISSED'} |")
    return 0 if all(r[3] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
