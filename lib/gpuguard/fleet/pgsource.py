"""The PostgreSQL history source (`gpuguard fleet history` with store.url): the same filters and rows as the
node's SQLite store (gpuguard.store.history_sqlite), from the central database. Healthy runs are counted, not listed;
a repeated problem is one row with its repeat count. Rows are streamed through server-side cursors."""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterator, Optional

from gpuguard.fleet.pgquery import drains_query, findings_query, healthy_runs_query, run_findings_query, runs_query
from gpuguard.store.filters import Filters
from gpuguard.store.history import present_row

PAGE = 500
_BUILD = {"runs": runs_query, "findings": findings_query, "drains": drains_query}


class PgHistory:
    healthy_summarized = True

    def __init__(self, conn: Any, label: str, now: Optional[float] = None) -> None:
        self.conn = conn
        self.label = [label]
        self.now = now
        self._n = 0
        self._healthy: dict[Filters, int] = {}

    def close(self) -> None:
        self.conn.close()

    def _scalar(self, sql: str, params: dict[str, Any]) -> int:
        row = self.conn.execute(sql, params).fetchone()
        return int(row[0] or 0)

    def healthy_runs(self, f: Filters) -> int:
        if f not in self._healthy:  # asked for by count("runs") and by the writer
            q = healthy_runs_query(f, time.time() if self.now is None else self.now)
            self._healthy[f] = 0 if q is None else self._scalar(q.sql, q.params)
        return self._healthy[f]

    def count(self, kind: str, f: Filters) -> int:
        q = _BUILD[kind](f, None, count=True)
        n = self._scalar(q.sql, q.params)
        return n + self.healthy_runs(f) if kind == "runs" else n

    def _stream(self, sql: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        from psycopg.rows import dict_row  # optional (gpuguard[fleet]): never at import time

        self._n += 1
        with self.conn.cursor(name=f"gg_history_{self._n}", row_factory=dict_row) as cur:
            cur.itersize = PAGE
            cur.execute(sql, params)
            yield from cur

    def rows(self, kind: str, f: Filters, limit: Optional[int]) -> Iterator[dict[str, Any]]:
        q = _BUILD[kind](f, limit)
        rows = self._stream(q.sql, q.params)
        if kind == "runs":
            rows = self._with_findings(rows)
        for r in rows:
            yield present_row(kind, r)

    def _with_findings(self, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        from psycopg.rows import dict_row  # optional (gpuguard[fleet]): never at import time

        while True:
            page = list(itertools.islice(rows, PAGE))
            if not page:
                return
            q = run_findings_query([(r["origin"], r["id"], r["started"]) for r in page])
            by_run: dict[tuple[str, int], list[dict[str, Any]]] = {}
            with self.conn.cursor(row_factory=dict_row) as cur:
                for fr in cur.execute(q.sql, q.params):
                    key = (fr.pop("origin"), fr.pop("run_key"))
                    by_run.setdefault(key, []).append(fr)
            for r in page:
                r["findings"] = by_run.get((r["origin"], r["id"]), [])
                yield r
