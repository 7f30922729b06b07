"""The fleet layer: central history in PostgreSQL (psycopg 3) fed from every node's SQLite store, and fleet reports.

Every hook records into the node's SQLite store first (`gpuguard.store.sqlite`); that store is the outbox. Rows are
shipped later, off the prolog's path: by the health check after its verdict (a small time budget), by the watch
daemon, and by `gpuguard fleet ship` (a systemd timer). A watermark per table in the store's `cursors` table says
what has been shipped; shipping is idempotent (keyed by the store's origin id and the local row id), so a
shipper that dies between the commit and the watermark update ships nothing twice. Centrally, healthy runs are
per-day counts and repeated problems one row with a count, in monthly partitions (docs/fleet.md).

Modules: `url` (validate/redact a store.url, pure), `query` (the filters every history source shares),
`pg` (connection, text cleaning), `schema` (the central schema and its version), `upgrade_v1` (from schema 1),
`partitions` (months, retention), `pgquery` (history SQL for PostgreSQL), `pgsource` (the PostgreSQL history
source), `ship` (the outbox, connection reuse), `shipbatch` (a batch -> rows, counts and repeats), `report` (fleet
reports), `cli` (`gpuguard fleet ...`), `devpg` (a throwaway PostgreSQL server for tests and the bench). Nothing
here is imported by a prolog.
"""
