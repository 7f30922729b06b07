"""Integration fixtures: a real local Slurm cluster (munge + slurmctld + slurmd per node) running gpuguard's
installed hooks over simulated GPU nodes (devtools.devsite)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from devtools.devcluster import missing_requirements
from devtools.devsite import DevSite


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


JOB = "#!/bin/sh\nsrun -l hostname\n"
