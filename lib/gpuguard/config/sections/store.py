"""The `store:` section: the node's SQLite history, the central PostgreSQL history, the verdict journal's home."""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.config.fields import Section, key, number, section, string
from gpuguard.util.nodedirs import default_store_path


def postgres_url(x: Any) -> Any:
    """store.url; gpuguard.config.pgurl is imported only when a url is configured (the hooks stay lean)."""
    if x is None:
        return None
    from gpuguard.config.pgurl import validate_url

    return validate_url(x)


@section
class StoreConfig(Section):
    """`store:` where history and the verdict journal live."""

    # SQLite history; "{node}" is replaced by the node name (several slurmd on one host); default: state.db in the
    # node's state directory ($GPUGUARD_STATE_DIR from gpuguard.env, else /var/lib/gpuguard/state.db)
    path: str = key(string(), default_factory=default_store_path)
    # central history (gpuguard.fleet): postgresql://USER@HOST[:PORT]/DB, the password in ~/.pgpass or
    # $PGPASSFILE rather than here; hooks record locally and ship asynchronously; null = SQLite only
    url: Optional[str] = key(postgres_url, None)
    # local runs/findings/drains older than this are pruned by the health check (never less than
    # reboot.window_days; never rows not yet shipped to store.url); null = keep everything
    retention_days: Optional[float] = key(number(allow_none=True), 90.0)
    # the health check ships and prunes for at most this long after its verdict
    ship_budget_s: float = key(number(), 2.0)
    ship_interval_s: float = key(number(), 60.0)  # how often the watch daemon ships
    # the verdict journal (pending drains, kernel-log positions): a tmpfs by default, so a full, read-only or
    # damaged store filesystem never loses a verdict or skips evidence; null = $GPUGUARD_RUNTIME_DIR (set in
    # gpuguard.env beside the hooks) or /run/gpuguard
    runtime_dir: Optional[str] = key(string(allow_none=True), None)
    # central history (store.url): `gpuguard fleet prune` drops months that ended longer ago than this (whole
    # months: up to a month more is kept); null = keep everything
    fleet_retention_days: Optional[float] = key(number(allow_none=True), 400.0)

    def path_for(self, node: str) -> str:
        """The SQLite file of `node` ("{node}" in `path` replaced)."""
        return self.path.replace("{node}", node)
