"""Integration fixtures: a real local Slurm cluster (munge + slurmctld + slurmd per node) running gpuguard's
installed hooks over simulated GPU nodes (devtools.devsite), and the unit suite's real local servers (webhook,
SMTP, Alertmanager: tests/unit/notify_servers.py, alertmanager_server.py) that notifications are delivered to.

A fresh cluster per test: booting one takes ~0.15 s and ~0.1 s of CPU here (munged, slurmctld, one slurmd per node;
DevCluster's fast settings), so sharing one per module would save little and let one test's drains, jobs and
stores leak into the next. A module whose tests only read one cluster's state shares it (test_metrics_slurm.py,
test_notify_slurm.py, test_devcluster.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from devtools.devcluster import missing_requirements
from devtools.devpg import DevPostgres
from devtools.devpg import missing_requirements as missing_pg_requirements
from devtools.devsite import DevSite

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the servers above and test_metrics' helpers
from notify_servers import WebhookServer  # noqa: E402
from watchproc import Watch  # noqa: E402


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    missing = missing_requirements()
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if missing:
                item.add_marker(pytest.mark.skip(reason="cannot boot a local Slurm cluster: " + "; ".join(missing)))


@pytest.fixture
def site_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., DevSite]]:
    sites: list[DevSite] = []

    def make(**kw: Any) -> DevSite:
        site = DevSite(workdir=tmp_path_factory.mktemp("site"), **kw)
        sites.append(site)
        return site.start()

    yield make
    for s in sites:
        try:
            s.cluster.stop()
        except Exception:  # noqa: BLE001 - teardown must go on for the other sites
            pass


@pytest.fixture
def hook() -> Iterator[WebhookServer]:
    """A real local HTTP server that records every webhook POST."""
    server = WebhookServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def pg() -> Iterator[DevPostgres]:
    """A real PostgreSQL server (Debian's postgresql in a temp dir, devtools.devpg), booted once per test module."""
    missing = missing_pg_requirements()
    if missing:
        pytest.skip("cannot boot PostgreSQL: " + "; ".join(missing))
    server = DevPostgres(settings={"log_connections": "on"}).start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def db(pg: DevPostgres, request: pytest.FixtureRequest) -> str:
    """A fresh database owned by the gpuguard role; its URL carries the password."""
    from pghelpers import new_db

    return new_db(pg, "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:50].lower())


@pytest.fixture
def watch_factory(tmp_path: Path) -> Iterator[Callable[..., Watch]]:
    started: list[Watch] = []

    def start(site: Any, node: str = "node1") -> Watch:
        w = Watch(site, node, tmp_path)
        started.append(w)
        return w

    yield start
    for w in started:  # the daemons never outlive a test
        w.stop()
