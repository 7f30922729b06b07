"""Issue 14, checks layer, on a real Slurm cluster running the installed hooks as slurmd runs them (`env -i`, the
hook scripts): a value NVML could not read is never taken for "cleared" (a reset-class drain stays), an unsupported
NVLink query is not "no NVLinks", a launch choice (fewer EFA interfaces than the profile) warns while a device that
disappears from a node that had it drains, a user filling a user-writable filesystem cannot drain the node, and a
reason keeps the apostrophe of "the GPU's slowdown temperature"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nodeview import drained, findings, hc, reason

from gpuguard.slurm.reason import parse_reason

JOB = "#!/bin/sh\nsrun -l hostname\n"  # one step: every node of the job prints its name


# --------------------------------------------------------------------------- item 5: unknown is never clear


@pytest.mark.parametrize("error", ["NOT_SUPPORTED", "UNKNOWN"])
def test_ecc_drain_is_not_lifted_when_the_counter_becomes_unreadable(site_factory, error):
    site = site_factory(nodes=1)
    site.set_scenario("node1", "ecc-dbe")
    hc(site)
    assert drained(site) and reason(site).action == "reset"
    # same GPU, no reset: NVML now answers an error for the ECC counters of GPU 5 (and the Xid is behind the cursor)
    site.write_scenario("node1", "healthy-p5",
                        gpus={"overrides": {5: {"errors": {"nvmlDeviceGetTotalEccErrors": error}}}})
    runs = [hc(site) for _ in range(3)]
    assert drained(site), f"undrained on an ECC count NVML could not read ({error})"
    for run in runs:
        ecc = findings(run, "gpu.ecc")
        assert ecc and all(f["severity"] != "ok" for f in ecc), ecc


@pytest.mark.parametrize("unreadable", [
    {"recovery_action": None},  # the field answers NOT_SUPPORTED for that GPU
    {"errors": {"nvmlDeviceGetFieldValues": "UNKNOWN"}},  # the whole field query fails
    {"field_errors": {"recovery_action": "UNKNOWN"}},  # only that field fails (the call succeeds)
], ids=["field-not-supported", "call-unknown", "field-unknown"])
def test_recovery_action_drain_is_not_lifted_when_the_field_becomes_unreadable(site_factory, unreadable):
    site = site_factory(nodes=1)
    site.write_scenario("node1", "healthy-p5", gpus={"overrides": {2: {"recovery_action": 1}}})  # GPU_RESET
    hc(site)
    assert drained(site) and reason(site).keyword == "RECOVERY" and reason(site).action == "reset"
    site.write_scenario("node1", "healthy-p5", gpus={"overrides": {2: unreadable}})
    runs = [hc(site) for _ in range(3)]
    assert drained(site), "undrained on a recovery action NVML could not read"
    for run in runs:
        ra = findings(run, "gpu.recovery_action")
        assert ra and all(f["severity"] != "ok" for f in ra), ra


def test_nvlink_state_not_supported_is_not_a_reboot_drain(site_factory):
    site = site_factory(nodes=1)
    site.write_scenario("node1", "healthy-p5",
                        gpus={"overrides": {3: {"errors": {"nvmlDeviceGetNvLinkState": "NOT_SUPPORTED"}}}})
    run = hc(site)
    assert not drained(site), reason(site)
    (nvl,) = [f for f in findings(run, "gpu.nvlink") if f["severity"] != "ok"]
    assert nvl["severity"] == "incomplete" and nvl["gpu"] == 3 and "NOT_SUPPORTED" in nvl["message"]
    assert run["verdict"] == "warn"
    # never escalated to a drain however often it repeats: a driver/GPU capability is the same on every node
    for _ in range(4):
        hc(site)
    assert not drained(site)


# --------------------------------------------------------------------------- item 7: launch choice vs hardware


@pytest.mark.parametrize("efa", [4, 0])
def test_a_launch_with_fewer_efa_interfaces_warns(site_factory, efa):
    """A p5 launched with 4 of its 32 EFA interfaces (or none, for single-node work): the platform's norm when a
    launch template says so, on every node at once. It warns; it must not drain (that would drain the fleet)."""
    site = site_factory(nodes=2)
    site.write_scenario("node1", "healthy-p5", fabric={"efa": {"count": efa}})
    run = hc(site)
    assert not drained(site), reason(site)
    (f,) = findings(run, "fabric.efa")
    assert f["severity"] == "warn" and f"32 EFA devices expected, {efa} found" in f["message"], f
    hc(site)
    assert not drained(site)
    job = site.cluster.sbatch(JOB, "-N1", "-w", "node1", "--gres=gpu:8")
    assert site.cluster.wait_job(job, timeout=60)["JobState"] == "COMPLETED"
    assert not drained(site)


def test_an_efa_device_that_disappears_drains(site_factory):
    site = site_factory(nodes=1)
    hc(site)  # the node is seen with its 32 EFA devices
    site.set_scenario("node1", "missing-efa")  # 4 of them are gone
    hc(site)
    assert drained(site)
    r = reason(site)
    assert (r.check_id, r.keyword) == ("fabric.efa", "EFA") and "28" in r.detail


def test_a_node_launched_with_4_efa_drains_when_it_loses_one(site_factory):
    site = site_factory(nodes=1)
    site.write_scenario("node1", "healthy-p5", fabric={"efa": {"count": 4}})
    hc(site)
    assert not drained(site)
    site.write_scenario("node1", "healthy-p5", fabric={"efa": {"count": 3}})
    hc(site)
    assert drained(site) and reason(site).check_id == "fabric.efa"


# --------------------------------------------------------------------------- item 11: users cannot drain nodes


def _full_dir(tmp_path: Path, name: str, mode: int) -> str:
    d = tmp_path / name
    d.mkdir()
    os.chmod(d, mode)
    return str(d)


def test_a_user_filling_tmp_cannot_drain_the_node(site_factory, tmp_path):
    """A path users can write (mode 1777, as /tmp): free space below the limit (here: a limit no disk meets, as a
    user filling it would make it) warns, never drains."""
    tmp = _full_dir(tmp_path, "tmp", 0o1777)
    site = site_factory(nodes=1, config={"checks": {"sys.disk": {"paths": [{"path": tmp, "min_free_gib": 10 ** 7}]}}})
    run = hc(site)
    assert not drained(site), reason(site)
    (f,) = findings(run, "sys.disk")
    assert f["severity"] == "warn" and tmp in f["message"]
    p = site.run_hook("prolog", "node1", SLURM_JOB_ID="77", SLURM_JOB_GPUS="0")
    assert p.returncode == 0 and not drained(site)


def test_a_full_root_owned_filesystem_drains(site_factory, tmp_path):
    var = _full_dir(tmp_path, "var-lib-slurm", 0o755)  # owned by root (the tests run as root), not writable by users
    site = site_factory(nodes=1, config={"checks": {"sys.disk": {
        "paths": [{"path": var, "min_free_gib": 10 ** 7, "root_owned": True}]}}})
    hc(site)
    assert drained(site) and reason(site).check_id == "sys.disk"


def test_root_owned_claim_on_a_world_writable_path_warns_and_says_so(site_factory, tmp_path):
    tmp = _full_dir(tmp_path, "scratch", 0o1777)
    site = site_factory(nodes=1, config={"checks": {"sys.disk": {
        "paths": [{"path": tmp, "min_free_gib": 10 ** 7, "root_owned": True}]}}})
    run = hc(site)
    assert not drained(site)
    (f,) = findings(run, "sys.disk")
    assert f["severity"] == "warn" and "writable" in f["message"] and "root_owned" in f["message"]


# --------------------------------------------------------------------------- item 9: readable reasons


def test_reason_keeps_the_apostrophe(site_factory):
    site = site_factory(nodes=1)
    site.set_scenario("node1", "hot-gpu")
    site.write_scenario("node1", "healthy-p5", gpus={"overrides": {6: {"temperature_c": 91}}})
    hc(site)
    raw = site.cluster.node_info("node1")["Reason"]
    assert "the GPU's slowdown temperature" in raw, raw
    r = parse_reason(raw)
    assert (r.check_id, r.keyword) == ("gpu.temperature", "THERMAL") and "GPU's" in r.detail
