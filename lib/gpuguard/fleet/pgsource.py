"""`gpuguard fleet history` rows from PostgreSQL: the same filters, SQL shape and output as `gpuguard history`
(gpuguard.history writes them). Rows are streamed through a server-side cursor."""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

from gpuguard.fleet.query import PG, Filters, drains_query, findings_query, run_findings_query, runs_query

PAGE = 500


class PgHistory:
    def __init__(self, conn: Any, label: str) -> None:
        self.conn = conn
        self.label = [label]
        self._n = 0

    def close(self) -> None:
        self.conn.close()

    def count(self, kind: str, f: Filters) -> int:
        build = {"runs": runs_query, "findings": findings_query, "drains": drains_query}[kind]
        q = build(PG, f, None, count=True)
        row = self.conn.execute(q.sql, q.params).fetchone()
        return int(row[0])

    def _stream(self, sql: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        from psycopg.rows import dict_row

        self._n += 1
        with self.conn.cursor(name=f"gg_history_{self._n}", row_factory=dict_row) as cur:
            cur.itersize = PAGE
            cur.execute(sql, params)
            yield from cur

    def rows(self, kind: str, f: Filters, limit: Optional[int]) -> Iterator[dict[str, Any]]:
        from gpuguard.history import _present

        build = {"runs": runs_query, "findings": findings_query, "drains": drains_query}[kind]
        q = build(PG, f, limit)
        rows = self._stream(q.sql, q.params)
        if kind == "runs":
            rows = self._with_findings(rows)
        for r in rows:
            yield _present(kind, r)

    def _with_findings(self, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        from psycopg.rows import dict_row

        while True:
            page = list(itertools.islice(rows, PAGE))
            if not page:
                return
            q = run_findings_query(PG, [(r["origin"], r["id"]) for r in page])
            by_run: dict[tuple[str, int], list[dict[str, Any]]] = {}
            with self.conn.cursor(row_factory=dict_row) as cur:
                for fr in cur.execute(q.sql, q.params):
                    key = (fr.pop("origin"), fr.pop("run_key"))
                    fr["evidence"] = {} if fr.get("evidence") is None else fr["evidence"]
                    by_run.setdefault(key, []).append(fr)
            for r in page:
                r["findings"] = by_run.get((r["origin"], r["id"]), [])
                yield r

