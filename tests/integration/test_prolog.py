"""The prolog on a real Slurm cluster: healthy jobs run, faulty nodes are drained with gpuguard's reason and the
job is requeued onto healthy nodes, admin drains are never touched, hangs never hold a node."""

from __future__ import annotations

import time

import pytest

from gpuguard.slurm.reason import parse_reason

JOB = "#!/bin/sh\nsrun -l hostname\n"  # one step: every node of the job prints its name


def node_reason(site, node):
    return site.cluster.node_info(node).get("Reason")


def test_healthy_job_runs_and_nothing_is_drained(site_factory):
    site = site_factory(nodes=3)
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    info = site.cluster.wait_job(job, timeout=30)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0"
    for node in site.cluster.node_names:
        assert "DRAIN" not in site.cluster.node_flags(node)
    ran = [n for n in site.cluster.node_names if site.runs(n, "prolog")]
    assert len(ran) == 2
    for node in ran:
        run = site.runs(node, "prolog")[0]
        assert run["verdict"] == "pass" and run["job_id"] == job and run["profile"] == "p5.48xlarge"
        checks = {f["check_id"]: f["severity"] for f in run["findings"]}
        # the prolog really looked at the job's 8 GPUs through NVML, the fabric and the kernel log
        assert checks["gpu.count"] == checks["gpu.nvlink"] == checks["fabric.efa"] == checks["gpu.xid"] == "ok"


@pytest.mark.slow(9)
def test_faulty_node_is_drained_and_job_lands_on_healthy_nodes(site_factory):
    site = site_factory(nodes=3)
    site.set_scenario("node2", "xid79")
    t0 = time.monotonic()
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    info = site.cluster.wait_job(job, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    assert info["Restarts"] == "1" and info["NodeList"] == "node[1,3]"
    assert "DRAIN" in site.cluster.node_flags("node2")
    reason = node_reason(site, "node2")
    parsed = parse_reason(reason)
    assert parsed and parsed.check_id == "gpu.xid" and parsed.keyword == "XID79" and parsed.action == "reboot", reason
    assert "0000:86:00" in reason
    drains = site.store("node2").drains("node2")
    assert drains[0]["outcome"] == "done" and drains[0]["reason"] == reason
    print(f"faulty node drained, job requeued and completed in {time.monotonic() - t0:.1f}s")


@pytest.mark.slow(10)
def test_ecc_and_missing_efa_reasons(site_factory):
    site = site_factory(nodes=3)
    site.set_scenario("node1", "ecc-dbe")
    assert site.run_hook("healthcheck", "node2").returncode == 0  # node2 is seen with its 32 EFA devices ...
    site.set_scenario("node2", "missing-efa")  # ... then 4 are gone (a node first seen with 28 only warns)
    job = site.cluster.sbatch(JOB, "-N1", "--gres=gpu:8")
    job2 = site.cluster.sbatch(JOB, "-N1", "--gres=gpu:8")
    for j in (job, job2):
        assert site.cluster.wait_job(j, timeout=60)["JobState"] == "COMPLETED"
    r1, r2 = parse_reason(node_reason(site, "node1")), parse_reason(node_reason(site, "node2"))
    assert (r1.check_id, r1.keyword) in {("gpu.xid", "XID48"), ("gpu.ecc", "ECC")}
    assert (r2.check_id, r2.keyword) == ("fabric.efa", "EFA") and "28 found" in r2.detail


def test_admin_drained_node_is_never_touched(site_factory):
    site = site_factory(nodes=2)
    site.cluster.drain("node1", "admin: replacing PSU [ticket 4411] see=jira")
    before = site.cluster.node_info("node1")
    site.set_scenario("node1", "xid79")
    # Slurm does not schedule on a drained node, so run the installed prolog the way slurmd would.
    p = site.run_hook("prolog", "node1", SLURM_JOB_ID="999", SLURM_JOB_GPUS="0,1,2,3,4,5,6,7")
    assert p.returncode == 1  # the hardware is bad: the prolog still fails the job
    after = site.cluster.node_info("node1")
    assert after["Reason"] == "admin: replacing PSU [ticket 4411] see=jira"
    assert after["ReasonTime"] == before["ReasonTime"] and after["ReasonUser"] == before["ReasonUser"]
    d = site.store("node1").drains("node1")[0]
    assert d["outcome"] == "foreign" and d["detail"].startswith("drained by someone else")


@pytest.mark.slow(12)
def test_hung_nvml_still_ends_the_prolog_in_its_deadline(site_factory):
    site = site_factory(nodes=3, config={"deadlines": {"nvml_s": 2, "prolog_s": 8}})
    site.set_scenario("node2", "nvml-hang")
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    info = site.cluster.wait_job(job, timeout=60)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[1,3]"
    parsed = parse_reason(node_reason(site, "node2"))
    assert (parsed.check_id, parsed.keyword) == ("gpu.nvml", "TIMEOUT")
    run = site.runs("node2", "prolog")[0]
    # NVML gets its deadline, then a second wait (slow is not hung: persistence mode off can take seconds) cut to
    # what the gather stage may use: the act stage keeps its share of the 8 s to drain (gpuguard.pipeline.budget)
    assert 3000 <= run["duration_ms"] < 6000, run["duration_ms"]
    assert site.store("node2").drains("node2")[0]["outcome"] == "done"


@pytest.mark.slow(9)
def test_hung_scontrol_still_ends_the_prolog(site_factory, tmp_path):
    hung = tmp_path / "scontrol"
    hung.write_text("#!/bin/sh\nsleep 600\n")
    hung.chmod(0o755)
    site = site_factory(nodes=3, config={"deadlines": {"scontrol_s": 1.5, "prolog_s": 8},
                                         "slurm": {"scontrol": str(hung)}})
    site.set_scenario("node2", "xid79")
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    info = site.cluster.wait_job(job, timeout=60)
    # gpuguard could not set its reason, so Slurm drains with its own; the job still moves on
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[1,3]"
    assert node_reason(site, "node2") == "Prolog error"
    run = site.runs("node2", "prolog")[0]
    assert run["duration_ms"] < 4000, run["duration_ms"]
    d = site.store("node2").drains("node2")[0]
    assert d["outcome"] == "failed" and "did not answer" in d["detail"]


def test_malformed_config_fails_open_with_a_clear_error(site_factory):
    site = site_factory(nodes=2)
    # the site's own file (its nodes' stores, scenarios) with one bad value
    site.write_config({"deadlines": {"prolog_s": "soon"}})
    bad_line = site.config_path.read_text().splitlines().index("  prolog_s: soon") + 1
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    assert site.cluster.wait_job(job, timeout=30)["JobState"] == "COMPLETED"
    assert not any("DRAIN" in site.cluster.node_flags(n) for n in site.cluster.node_names)
    check = site.gpuguard("config", "--config", str(site.config_path))
    assert check.returncode == 2
    assert f"{site.config_path}: line {bad_line}: deadlines.prolog_s: expected a number" in check.stderr


def test_forged_xid_from_userspace_does_not_drain(site_factory):
    site = site_factory(nodes=2)
    site.set_scenario("node1", "forged-xid")
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    assert site.cluster.wait_job(job, timeout=30)["JobState"] == "COMPLETED"
    assert "DRAIN" not in site.cluster.node_flags("node1")
    run = site.runs("node1", "prolog")[0]
    xid = [f for f in run["findings"] if f["check_id"] == "gpu.xid"][0]
    assert run["verdict"] == "warn" and xid["severity"] == "warn" and "not from the kernel" in xid["message"]
