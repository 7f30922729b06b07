"""Metrics from hooks that slurmd itself runs (bare environment, real prolog/epilog of a real job) and from the
health check as slurmd would run it: one gpuguard_node.prom per node that the real promtool accepts, whose drain
state agrees with what Slurm shows an admin."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from test_metrics import collect_dir, promtool_check_metrics, read_metrics, value, wait_for  # the unit helpers

from devtools.devsite import DevSite
from gpuguard.slurm.reason import parse_reason

JOB = "#!/bin/sh\nsrun -l hostname\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevSite]:
    workdir = tmp_path_factory.mktemp("metrics-site")
    s = DevSite(nodes=2, workdir=workdir, prolog=True, epilog=True,
                config={"metrics": {"textfile_dir": str(workdir / "prom" / "{node}")}})
    s.start()
    try:
        yield s
    finally:
        s.cluster.stop()


def node_file(site: DevSite, node: str) -> Path:
    return site.workdir / "prom" / node / "gpuguard_node.prom"


def test_a_job_leaves_one_valid_file_per_node_with_its_prolog_and_epilog(site):
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    info = site.cluster.wait_job(job, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    for node in site.cluster.node_names:
        path = node_file(site, node)
        promtool_check_metrics(path)
        assert sorted(p.name for p in path.parent.iterdir()) == ["gpuguard_node.prom"]
        collect_dir(path.parent)
        m = read_metrics(path)
        assert value(m, "gpuguard_run_verdict", node=node, kind="prolog", verdict="pass") == 1
        assert value(m, "gpuguard_runs_total", node=node, kind="prolog", verdict="pass") >= 1
        assert value(m, "gpuguard_node_drained", node=node) == 0
        # the epilog runs after the job's end is reported: wait for its series
        wait_for(lambda: "epilog" in {lab.get("kind") for lab, _ in read_metrics(path)["gpuguard_run_verdict"]},
                 30, f"the epilog's metrics on {node}")
        assert value(read_metrics(path), "gpuguard_run_verdict", kind="epilog", verdict="pass") == 1
        promtool_check_metrics(path)


def test_a_health_check_drain_shows_in_the_metrics_as_slurm_shows_it(site):
    site.set_scenario("node2", "xid79")
    p = site.run_hook("healthcheck", "node2")  # the bare environment slurmd gives a HealthCheckProgram
    assert p.returncode in (0, 1), p.stderr
    reason = parse_reason(site.cluster.node_info("node2").get("Reason", ""))
    assert reason is not None and "DRAIN" in site.cluster.node_flags("node2")
    m = read_metrics(node_file(site, "node2"))
    drained = [(lab, v) for lab, v in m["gpuguard_node_drained"]]
    # the GPU the Xid names: GPU 3 when an earlier run of this node inventoried its PCI address (it fell off the
    # bus, NVML no longer lists it), else the address itself
    (labels, v), = drained
    assert v == 1.0 and labels.pop("gpu") in ("3", "0000:86:00"), drained
    assert labels == {"node": "node2", "check": reason.check_id, "keyword": reason.keyword}
    assert value(m, "gpuguard_drain_operations_total", op="drain", outcome="done") == 1
    assert value(m, "gpuguard_xid_events_total", **{"class": "fatal"}) == 1
    assert value(m, "gpuguard_run_verdict", kind="healthcheck", verdict="drain") == 1
    assert value(m, "gpuguard_run_verdict", kind="prolog", verdict="pass") == 1  # the job's prolog is still there
    promtool_check_metrics(node_file(site, "node2"))
    assert value(read_metrics(node_file(site, "node1")), "gpuguard_node_drained", node="node1") == 0
