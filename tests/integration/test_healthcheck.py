"""The health check on a real Slurm cluster, run as slurmd runs it (the installed hook, a bare environment): drains on
hardware faults, undrains only what it drained once the cause has cleared, leaves admins' drains alone, pins
flapping nodes, waits for an admin on replace-class faults, and runs from slurmd itself. Which fault waits for what
(a reset, a reboot; escalation to `replace` after reboots) is decided by the pipeline alone: tests/unit/test_undrain.py
runs those on a simulated node with the in-memory Slurm."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from nodeview import drained, hc, newest_run, reason

from devtools.devsite import DevSite


def test_drains_on_row_remap_and_undrains_after_recovery(site_factory):
    site = site_factory(nodes=2)
    site.set_scenario("node1", "row-remap-pending")
    run = hc(site)
    assert run["verdict"] == "drain" and drained(site)
    r = reason(site)
    assert (r.check_id, r.keyword, r.context, r.action) == ("gpu.row_remap", "ROWREMAP", "healthcheck", "reset")
    site.set_scenario("node1", "healthy-p5")  # the GPU was reset: no remap pending any more
    hc(site)
    assert drained(site), "one passing run is not enough (undrain.passes = 2)"
    hc(site)
    assert not drained(site)
    d = site.store("node1").drains("node1")[0]
    assert (d["op"], d["outcome"], d["check_id"]) == ("undrain", "done", "gpu.row_remap")
    assert "DRAIN" not in site.cluster.node_flags("node2")


def test_admin_drain_is_never_touched(site_factory):
    site = site_factory(nodes=1)
    site.cluster.drain("node1", "admin: RMA ticket 7731 [do not resume]")
    for scenario in ("healthy-p5", "xid79", "healthy-p5"):
        site.set_scenario("node1", scenario)
        hc(site)
        info = site.cluster.node_info("node1")
        assert info["Reason"] == "admin: RMA ticket 7731 [do not resume]" and drained(site)


def test_flapping_node_stays_drained(site_factory):
    site = site_factory(nodes=1, config={"undrain": {"passes": 1, "max_undrains": 2}})
    for _ in range(2):
        site.set_scenario("node1", "ecc-dbe")
        hc(site)
        assert drained(site)
        site.set_scenario("node1", "healthy-p5")
        hc(site)
        assert not drained(site)
        # the same injected fault again (a fresh Xid 48 line, another ECC counter bump)
        site.write_scenario("node1", "ecc-dbe", kernel_log=[f"NVRM: Xid (PCI:0000:a8:00): 48, pid=1, name=x, DBE {time.time()}"])
        hc(site)
        assert drained(site)
        site.set_scenario("node1", "healthy-p5")
    hc(site)
    r = reason(site)
    assert drained(site) and r.keyword == "FLAPPING" and r.action == "replace", r
    hc(site)
    assert drained(site)
    refused = site.gpuguard("undrain", "node1")
    assert refused.returncode == 1 and "FLAPPING" in refused.stderr
    assert site.gpuguard("undrain", "node1", "--force").returncode == 0
    assert not drained(site)


def test_replace_class_waits_for_an_admin(site_factory):
    site = site_factory(nodes=1)
    site.write_scenario("node1", "healthy-p5", gpus={"overrides": {2: {"remap_failure": True}}})
    hc(site)
    assert reason(site).action == "replace"
    site.set_scenario("node1", "healthy-p5")
    for _ in range(3):
        hc(site)
    assert drained(site)
    assert site.gpuguard("undrain", "node1").returncode == 0  # the admin, after the repair
    assert not drained(site)


def timed_hook(site, kind: str, node: str = "node1") -> float:
    t0 = time.monotonic()
    p = site.run_hook(kind, node)
    assert p.returncode in (0, 1), p.stderr
    return time.monotonic() - t0


def test_hung_nvml_ends_within_the_health_check_budget(site_factory):
    """The budget is the hook's own (deadlines.healthcheck_s, counted from its start): the run it records fits in
    it. Seen from outside, its process also starts and ends: a healthy health check on the same node just before
    measures what that costs on this machine now (seconds on a loaded one), and the hung one may take no more than
    the budget beyond it."""
    site = site_factory(nodes=1, config={"deadlines": {"nvml_s": 2, "healthcheck_s": 5}})
    healthy_s = timed_hook(site, "healthcheck")
    site.set_scenario("node1", "nvml-hang")
    took = timed_hook(site, "healthcheck")
    run = newest_run(site, "node1", "healthcheck", count=2)
    assert run["verdict"] == "drain" and run["duration_ms"] < 5000, run
    assert took < 5 + healthy_s, (took, healthy_s)
    assert (reason(site).check_id, reason(site).keyword) == ("gpu.nvml", "TIMEOUT")


def test_concurrent_prologs_and_health_checks(site_factory):
    site = site_factory(nodes=1)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(site.run_hook, "healthcheck", "node1") for _ in range(4)]
        futs += [ex.submit(site.run_hook, "prolog", "node1", SLURM_JOB_ID=str(100 + i), SLURM_JOB_GPUS="0,1")
                 for i in range(4)]
        assert all(f.result().returncode == 0 for f in futs)
    runs = site.runs("node1")
    assert len(runs) == 8 and all(r["verdict"] == "pass" for r in runs)
    assert not drained(site)


def test_slurmd_runs_the_health_check_itself(tmp_path):
    """HealthCheckProgram= as an admin configures it: slurmd runs it at start (before the node registers:
    it must not block) and every interval; a bad node is drained without anyone running anything."""
    from devtools.devcluster import missing_requirements

    if missing_requirements():
        pytest.skip("; ".join(missing_requirements()))
    site = DevSite(nodes=2, workdir=tmp_path / "site", prolog=False, healthcheck=True, health_check_interval=2)
    site.set_scenario("node2", "ecc-dbe")
    with site:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not drained(site, "node2"):
            time.sleep(0.5)
        assert drained(site, "node2"), site.cluster.log_tails()
        assert reason(site, "node2").context == "healthcheck"
        assert not drained(site, "node1")
        assert site.runs("node1", "healthcheck"), "slurmd ran the health check on the healthy node too"


def test_reboot_class_fault_asks_slurm_for_a_reboot(site_factory, tmp_path):
    """reboot.auto: a reboot-class drain also runs `scontrol reboot ASAP nextstate=RESUME` (RebootProgram set)."""
    marker = tmp_path / "rebooted"
    prog = tmp_path / "reboot-program"
    prog.write_text(f"#!/bin/sh\ntouch {marker}\n")  # a stand-in for /sbin/reboot
    prog.chmod(0o755)
    site = site_factory(nodes=2, config={"reboot": {"auto": True}}, slurm_conf={"RebootProgram": str(prog)})
    site.set_scenario("node1", "xid79")
    run = hc(site)
    assert run["verdict"] == "drain"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not marker.exists():
        time.sleep(0.2)
    assert marker.exists(), "slurmd ran the RebootProgram for the idle node"
    assert reason(site).keyword == "XID79"
    assert site.store("node1").drains("node1")[0]["outcome"] == "done"
    assert "DRAIN" not in site.cluster.node_flags("node2")
