"""The fleet layer: central history in PostgreSQL (psycopg 3) fed from every node's SQLite store, and fleet reports.

Every hook records into the node's SQLite store first (`gpuguard.store`); that store is the outbox. Rows are
shipped later, off the prolog's path: by the health check after its verdict (a small time budget), by the watch
daemon, and by `gpuguard fleet ship` (a systemd timer). A watermark per table in the store's `cursors` table says
what has been shipped; inserts are idempotent (keyed by the store's origin id and the local row id), so a
shipper that dies between the commit and the watermark update ships nothing twice.

Modules: `url` (validate/redact a store.url, pure), `query` (filters and SQL shared by SQLite and PostgreSQL),
`pg` (connection and schema), `ship` (the outbox), `report` (fleet reports), `cli` (`gpuguard fleet ...`),
`devpg` (a throwaway PostgreSQL server for tests). Nothing here is imported by a prolog.
"""
