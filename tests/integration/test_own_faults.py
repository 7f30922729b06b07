"""gpuguard's own surroundings failing never turns hardware evidence into a pass (issue 14).

Each test runs the installed hooks exactly as slurmd runs them (a bare environment, the hook scripts, through
`DevSite.run_hook`) or real jobs on the real local Slurm cluster, and injects one fault of gpuguard's own
surroundings: slurmctld stopped or hung while draining, a broken config, a damaged store, a hung NVML in the
health check, an admin undraining a node that still fails.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fsfaults import read_only
from nodeview import drained, reason
from notify_servers import WebhookServer

from devtools.devsite import DevSite
from gpuguard.util.fs import atomic_write

XID119 = ("NVRM: Xid (PCI:0000:86:00): 119, pid=2113, name=python3, Timeout after 6s of waiting for RPC response "
          "from GPU3 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x204).")
JOB = "#!/bin/sh\necho ran on $(hostname) $SLURMD_NODENAME\n"


def add_kernel_lines(site: DevSite, node: str, *lines: str) -> None:
    """New kernel messages on `node`, as the driver would log them (appended: earlier records keep their seq)."""
    path = site.scenarios / f"{node}.yaml"
    data: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    data["kernel_log"] = list(data.get("kernel_log") or []) + list(lines)
    atomic_write(path, yaml.safe_dump(data, sort_keys=False))


def hook(site: DevSite, kind: str, node: str, job: str = "", timeout: float = 90) -> Any:
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": "0,1", "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0"} \
        if kind != "healthcheck" else {}
    return site.run_hook(kind, node, timeout=timeout, **env)


FAST = {"deadlines": {"scontrol_s": 2.0}}


# --------------------------------------------------------------------------- 1. controller unreachable or slow


@pytest.mark.slow(10)
@pytest.mark.parametrize("fault", ["stopped", "hung"])
def test_a_drain_the_controller_could_not_take_is_applied_once_it_is_back(site_factory, fault):
    """A fresh Xid 119 (only in the kernel log) while slurmctld is stopped / SIGSTOPped: the health check cannot
    drain. Once slurmctld is back, the node is drained without a further fault, and a job sent to it never runs
    there (its prolog refuses it while the drain is pending, and applies it)."""
    site = site_factory(nodes=2, config=FAST)
    assert hook(site, "healthcheck", "node1").returncode == 0  # healthy: the kernel-log position is known
    add_kernel_lines(site, "node1", XID119)
    if fault == "stopped":
        site.cluster.stop_controller()
    else:
        site.cluster.pause_controller()
    try:
        t0 = time.monotonic()
        hook(site, "healthcheck", "node1")
        assert time.monotonic() - t0 < 25, "a hung controller must not hang the health check"
    finally:
        if fault == "stopped":
            site.cluster.start_controller()
        else:
            site.cluster.resume_controller()
    job = site.cluster.sbatch(JOB, "-w", "node1", "--requeue")
    site.cluster.wait_nodes(lambda f: "DRAIN" in f, nodes=["node1"], timeout=30)
    r = reason(site, "node1")
    assert r is not None and (r.check_id, r.keyword) == ("gpu.xid", "XID119"), site.cluster.node_info("node1")
    time.sleep(2)
    info = site.cluster.job_info(job)
    assert info["JobState"] != "COMPLETED" and "ran on" not in _output(site, job), info
    site.cluster.run(["scancel", job])


def test_prolog_refuses_jobs_while_its_drain_is_pending(site_factory):
    """The prolog that found the Xid could not drain (slurmctld hung); every later prolog on that node refuses its
    job until the drain has been applied, even though the Xid is behind the kernel-log position now."""
    site = site_factory(nodes=1, config=FAST)
    assert hook(site, "prolog", "node1", job="101").returncode == 0
    add_kernel_lines(site, "node1", XID119)
    site.cluster.pause_controller()
    try:
        assert hook(site, "prolog", "node1", job="102").returncode == 1
        assert hook(site, "prolog", "node1", job="103").returncode == 1, "still pending: still refusing jobs"
    finally:
        site.cluster.resume_controller()
    assert hook(site, "prolog", "node1", job="104").returncode == 1
    assert drained(site, "node1") and reason(site, "node1").keyword == "XID119"
    status = site.gpuguard("status")
    assert "node1" in status.stdout, status.stdout + status.stderr


# --------------------------------------------------------------------------- 2. a config mistake


BROKEN_CONFIGS = {
    "unknown key": lambda text: text + "\ndeadlines_typo: 1\n",
    "wrong type": lambda text: text.replace("logging:", "deadlines:\n  prolog_s: soon\nlogging:", 1),
    "yaml error": lambda text: text + "\nnode: [unclosed\n",
    "missing file": None,
}


@pytest.mark.slow(13)
def test_a_broken_config_keeps_protecting_and_says_so(site_factory):
    """The config broken three ways (and deleted) on a 3-node cluster with one Xid-79 node: the bad node is still
    drained, the healthy ones keep running jobs, and `gpuguard status` says the config is broken and where."""
    site = site_factory(nodes=3)
    for node in site.cluster.node_names:  # the site ran with a good config: it is the last good one
        assert hook(site, "healthcheck", node).returncode == 0
    good = site.config_path.read_text()
    site.set_scenario("node2", "xid79")
    for what, breaker in BROKEN_CONFIGS.items():
        if breaker is None:
            site.config_path.unlink()
        else:
            site.config_path.write_text(breaker(good))
        p = hook(site, "prolog", "node2", job="201")
        assert p.returncode == 1, (what, p.stderr)
        # the Xid 79 itself is judged once (first round); GPU 3 stays missing, so every later round drains for that
        assert drained(site, "node2") and reason(site, "node2").keyword in ("XID79", "GPUCOUNT"), what
        for node in ("node1", "node3"):
            job = site.cluster.sbatch(JOB, "-w", node)
            assert site.cluster.wait_job(job, timeout=30)["JobState"] == "COMPLETED", what
        status = site.gpuguard("status")
        assert "config" in status.stdout and "broken" in status.stdout, (what, status.stdout, status.stderr)
        if what in ("unknown key", "wrong type"):
            key = "deadlines_typo" if what == "unknown key" else "deadlines.prolog_s"
            assert key in status.stdout, status.stdout
        site.cluster.resume(node="node2", wait=False)
    site.config_path.write_text(good)


# --------------------------------------------------------------------------- 3. a damaged store


def test_a_corrupt_store_skips_no_evidence(site_factory):
    """The store replaced by garbage between two runs: an Xid 119 that arrived in between is still judged."""
    site = site_factory(nodes=1)
    assert hook(site, "prolog", "node1", job="301").returncode == 0
    add_kernel_lines(site, "node1", XID119)
    db = site.workdir / "state" / "node1.db"
    db.write_bytes(b"this is not an SQLite database\n" * 100)
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    p = hook(site, "prolog", "node1", job="302")
    assert p.returncode == 1, p.stderr
    assert drained(site, "node1") and reason(site, "node1").keyword == "XID119"


def test_a_store_found_damaged_is_replaced_loudly(site_factory):
    """Issue 27: the replacement was silent. Now the hook that replaced it logs an error naming the file and the
    damaged copy and pages once, and the node's metrics read gpuguard_history_store_ok 0 until a later good run."""
    site = site_factory(nodes=1)
    prom = site.workdir / "prom"
    receiver = WebhookServer()
    try:
        site.write_config({"notify": {"urls": [receiver.url("/pages")]}, "metrics": {"textfile_dir": str(prom)}})
        assert hook(site, "prolog", "node1", job="501").returncode == 0
        db = site.workdir / "state" / "node1.db"
        db.write_bytes(b"this is not an SQLite database\n" * 100)
        for suffix in ("-wal", "-shm"):
            Path(str(db) + suffix).unlink(missing_ok=True)
        assert hook(site, "prolog", "node1", job="502").returncode == 0
        aside = [p.name for p in db.parent.glob("node1.db.corrupt-*")]
        assert len(aside) == 1, aside
        lines = site.log_lines(f"history store {db} was damaged")
        assert len(lines) == 1 and " error: " in lines[0] and aside[0] in lines[0], site.log_lines()
        assert 'gpuguard_history_store_ok{node="node1"} 0' in (prom / "gpuguard_node.prom").read_text()
        end = time.monotonic() + 20
        while time.monotonic() < end and not any("store-replaced" in r["body"]["dedup_key"] for r in receiver.requests):
            time.sleep(0.1)
        assert hook(site, "healthcheck", "node1").returncode == 0
        assert 'gpuguard_history_store_ok{node="node1"} 1' in (prom / "gpuguard_node.prom").read_text()
        pages = [r["body"] for r in receiver.requests if "store-replaced" in r["body"]["dedup_key"]]
        assert len(pages) == 1 and aside[0] in pages[0]["message"], receiver.requests
        assert len(site.log_lines("was damaged")) == 1  # told once
    finally:
        receiver.close()


def test_a_read_only_store_does_not_re_drain_after_an_admin_undrain(site_factory, tmp_path):
    """Store on a read-only filesystem: the Xid is judged and drained once; after the admin's recorded undrain
    (`gpuguard undrain --force`: the condition clears) the next prolog does not drain it again for the same Xid."""
    site = site_factory(nodes=1)
    assert hook(site, "healthcheck", "node1").returncode == 0
    add_kernel_lines(site, "node1", XID119)
    with read_only(site.workdir / "state"):
        hook(site, "healthcheck", "node1")
        assert drained(site, "node1")
        forced = site.gpuguard("undrain", "node1", "--force")
        assert forced.returncode == 0, forced.stdout + forced.stderr
        p = hook(site, "prolog", "node1", job="401")
        assert p.returncode == 0, p.stderr
        assert not drained(site, "node1")


# --------------------------------------------------------------------------- 5. a hung NVML in the health check


@pytest.mark.slow(15)
def test_a_hung_nvml_drains_within_the_health_checks_own_deadline(site_factory):
    site = site_factory(nodes=1)
    site.set_scenario("node1", "nvml-hang")
    t0 = time.monotonic()
    hook(site, "healthcheck", "node1")
    took = time.monotonic() - t0
    assert drained(site, "node1"), site.log_lines()[-5:]
    assert took < 20 + 2, took  # deadlines.healthcheck_s (20) plus the interpreter's start
    line = site.log_lines("healthcheck node=node1")[-1]
    assert "drain=done" in line, line  # gpuguard itself drained it in time (not a timed-out scontrol)


# --------------------------------------------------------------------------- 9. gpuguard undrain


def test_undrain_rechecks_and_refuses_a_node_that_still_fails(site_factory):
    site = site_factory(nodes=1)
    site.set_scenario("node1", "missing-gpu")
    hook(site, "healthcheck", "node1")
    assert drained(site, "node1")
    refused = site.gpuguard("undrain", "node1")
    assert refused.returncode == 1 and "gpu.count" in refused.stderr, refused.stdout + refused.stderr
    assert drained(site, "node1")
    forced = site.gpuguard("undrain", "node1", "--force")
    assert forced.returncode == 0 and not drained(site, "node1")
    assert any("undrain" in line and "--force" in line for line in site.log_lines("node1")), site.log_lines()
    d = site.store("node1").drains("node1")[0]
    assert d["op"] == "undrain" and "--force" in d["detail"]


def test_admin_undrains_of_other_faults_do_not_make_a_node_flap(site_factory):
    """Two unrelated faults, each repaired and undrained by an admin, then a thermal drain: the health check lifts
    the thermal drain once it clears instead of pinning the node as FLAPPING [replace]."""
    site = site_factory(nodes=1, config={"undrain": {"passes": 1, "max_undrains": 2}})
    for scenario in ("missing-gpu", "row-remap-pending"):
        site.set_scenario("node1", scenario)
        hook(site, "healthcheck", "node1")
        assert drained(site, "node1")
        site.set_scenario("node1", "healthy-p5")
        assert site.gpuguard("undrain", "node1").returncode == 0
    site.set_scenario("node1", "hot-gpu")
    hook(site, "healthcheck", "node1")
    assert drained(site, "node1") and reason(site, "node1").keyword == "THERMAL"
    site.set_scenario("node1", "healthy-p5")
    hook(site, "healthcheck", "node1")
    r = reason(site, "node1")
    assert not drained(site, "node1"), r


def _output(site: DevSite, job: str) -> str:
    try:
        return site.cluster.job_output(job)
    except OSError:
        return ""


# --------------------------------------------------------------------------- 7/8. drain storms


def _health_check_round(site: DevSite) -> None:
    """Every node's health check at the same moment, as slurmd's HealthCheckInterval runs them."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(site.cluster.node_names)) as pool:
        list(pool.map(lambda n: hook(site, "healthcheck", n), site.cluster.node_names))


class SlurmWatcher:
    """slurmctld's view of every node, read over and over (`scontrol show node -o`) while something happens: what
    an admin watching `sinfo` would see, including a drain that lasted two seconds."""

    def __init__(self, site: DevSite) -> None:
        import threading

        self.site, self.seen, self.stop = site, {n: [] for n in site.cluster.node_names}, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            for name, info in self.site.cluster.nodes_info().items():
                flag = "DRAIN" in info.get("State", "")
                if not self.seen[name] or self.seen[name][-1] != flag:
                    self.seen[name].append(flag)
            time.sleep(0.05)

    def finish(self) -> dict[str, list[bool]]:
        self.stop.set()
        self.thread.join(10)
        return self.seen


STORM = {"checks": {"sys.memory": {"min_available_gib": 10 ** 6}}, "logging": {"level": "info"}}


def storm_pages(hook: Any, n: int = 1, timeout: float = 20.0) -> list[dict[str, Any]]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and len([r for r in hook.requests if "drain storm" in r["body"]["title"]]) < n:
        time.sleep(0.1)
    time.sleep(1.0)  # anything more would have come by now
    return [r["body"] for r in hook.requests if "drain storm" in r["body"]["title"]]


@pytest.mark.slow(20)
def test_a_check_failing_on_every_node_at_once_pages_instead_of_draining_the_partition(site_factory, hook):
    """A threshold no node meets (a config choice, applied to every node at once): 12 nodes run their health
    checks at the same instant. The storm guard lets the first `policy.storm_min_nodes` drain and holds the rest,
    decided before anything is drained: slurmctld, watched all along, never shows a node drained and then resumed
    (issue 27: 8 of 10 were undone 2 s later). One page for the storm, not one per held node; the next round takes
    no census on the held nodes and pages nothing."""
    site = site_factory(nodes=12, config={**STORM, "notify": {"urls": [hook.url("/pages")]}})
    watcher = SlurmWatcher(site)
    _health_check_round(site)
    time.sleep(1.0)
    seen = watcher.finish()
    drained_nodes = [n for n in site.cluster.node_names if drained(site, n)]
    assert len(drained_nodes) == 2, drained_nodes  # limit: max(storm_min_nodes 2, 10 % of 12)
    assert all(seen[n] == [False] for n in site.cluster.node_names if n not in drained_nodes), seen
    assert all(seen[n] == [False, True] for n in drained_nodes), seen
    held = site.log_lines("drain-storm guard")
    assert len(held) >= 10, held
    pages = storm_pages(hook)
    assert len(pages) == 1, [p["title"] for p in pages]
    # what the first node held knew when it decided: the nodes that had marked by then (on a loaded machine a few
    # of the round mark later; they rank after it, are held and page nothing)
    from gpuguard.slurm.hostlist import compress_hostlist

    assert f"Drained (the first 2): {compress_hostlist(drained_nodes)}." in pages[0]["message"], pages[0]["message"]
    comments = {n: site.cluster.node_info(n).get("Comment", "") for n in site.cluster.node_names}
    assert all(comments[n].startswith("gpuguard-storm:held:sys.memory:") for n in comments if n not in drained_nodes)
    assert all(comments[n] in ("", "(null)") for n in drained_nodes), comments
    _health_check_round(site)  # the next round: the drained ones stay drained, nobody else is drained
    assert [n for n in site.cluster.node_names if drained(site, n)] == drained_nodes
    assert len(site.log_lines("no new census until the storm window ends")) >= 10
    assert len(storm_pages(hook, timeout=2.0)) == 1
    site.write_config({"notify": {"urls": [hook.url("/pages")]}})  # the threshold fixed: the held nodes let go
    _health_check_round(site)
    assert all(site.cluster.node_info(n).get("Comment", "") in ("", "(null)") for n in site.cluster.node_names
               if n not in drained_nodes)


@pytest.mark.slow(12)
@pytest.mark.parametrize("sinfo", ["beside a wrapper scontrol", "failing"])
def test_the_storm_guard_is_never_silently_off(site_factory, hook, tmp_path, sinfo):
    """A site whose `slurm.scontrol` is a wrapper script has no sinfo beside it: found on PATH, like scontrol
    (issue 27: the census failed and 12 of 12 healthy nodes drained). A sinfo that does not work at all: every
    config-class drain is held, and paged, until it does."""
    wrapper = tmp_path / "site-bin" / "scontrol"
    wrapper.parent.mkdir()
    wrapper.write_text("#!/bin/sh\nexec /usr/bin/scontrol \"$@\"\n")
    wrapper.chmod(0o755)
    slurm: dict[str, Any] = {"scontrol": str(wrapper)}
    if sinfo == "failing":
        broken = tmp_path / "site-bin" / "sinfo-broken"
        broken.write_text("#!/bin/sh\necho 'sinfo: error: Unable to contact slurm controller' >&2\nexit 1\n")
        broken.chmod(0o755)
        slurm["sinfo"] = str(broken)
    site = site_factory(nodes=6, config={**STORM, "slurm": slurm, "notify": {"urls": [hook.url("/pages")]}})
    _health_check_round(site)
    drained_nodes = [n for n in site.cluster.node_names if drained(site, n)]
    pages = storm_pages(hook, 1 if sinfo != "failing" else 6)
    if sinfo == "failing":
        assert drained_nodes == [] and len(pages) == 6, (drained_nodes, [p["title"] for p in pages])
        assert all("no census of the partitions could be taken" in p["message"] for p in pages)
    else:
        assert len(drained_nodes) == 2 and len(pages) == 1, (drained_nodes, site.log_lines("storm"))


def test_unambiguous_hardware_evidence_is_never_held_back(site_factory):
    site = site_factory(nodes=6)
    for node in site.cluster.node_names:
        site.set_scenario(node, "xid79")
    _health_check_round(site)
    assert all(drained(site, n) for n in site.cluster.node_names)
