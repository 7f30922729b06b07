"""The NCCL fleet sweep on a real local Slurm cluster: nccl-tests jobs (a simulated all_reduce_perf whose
bandwidth comes from each node's scenario, a multi-node run as slow as its slowest member) submitted through
sbatch, the slow node isolated, drained with keyword NCCL and the measured figure, and only it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from devtools.devsite import scenario_path
from gpuguard.nccl import history
from gpuguard.slurm.hostlist import expand_hostlist
from gpuguard.slurm.reason import parse_reason
from devtools.nccl_tests_stub import install_stub


def _slow_scenario(tmp_path: Path, factor: float) -> Path:
    path = tmp_path / "slow-nccl.yaml"
    path.write_text(scenario_path("healthy-p5").read_text() + f"nccl: {{slow_factor: {factor}}}\n")
    return path


def _configure(site, tmp_path: Path, **extra) -> None:
    stub = install_stub(str(tmp_path / "bin"), str(site.scenarios))
    nccl = {"sweep_busbw_gbps": 300, "sweep_gpus_per_node": 2, "sweep_min_bytes": 268435456,
            "sweep_max_bytes": 1073741824, "sweep_mpi": "pmi2", "sweep_binary": str(stub), "sweep_workdir": str(tmp_path / "sweeps"),
            "sweep_job_timeout_s": 60, "history_path": str(tmp_path / "fleet.db")}
    nccl.update(extra)
    site.write_config({"nccl": nccl})


def test_sweep_finds_the_slow_node_and_drains_only_it(site_factory, tmp_path):
    """Slurm has a topology (topology.conf: leaf1 = node[1-2], leaf2 = node[3-4]): the report also groups the swept
    nodes by leaf switch, from `scontrol show topology`; one slow node of two is not its switch's fault."""
    site = site_factory(nodes=4, topology={"leaf1": "node[1-2]", "leaf2": "node[3-4]"})
    site.set_scenario("node3", str(_slow_scenario(tmp_path, 0.4)))
    _configure(site, tmp_path)
    t0 = time.monotonic()
    p = site.gpuguard("nccl", "sweep", "--partition", "gpu", timeout=150)
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stdout + p.stderr  # 1 = slow node(s) found

    flags = {n: site.cluster.node_flags(n) for n in site.cluster.node_names}
    assert "DRAIN" in flags["node3"], flags
    for node in ("node1", "node2", "node4"):
        assert "DRAIN" not in flags[node], (node, flags[node], p.stdout)
    reason = site.cluster.node_info("node3")["Reason"]
    parsed = parse_reason(reason)
    assert parsed and parsed.check_id == "nccl.sweep" and parsed.keyword == "NCCL" and parsed.context == "sweep", reason

    # the figure in the reason is the one measured in node3's 2-node run with a known-good node
    with history.open_history(str(tmp_path / "fleet.db")) as st:
        sweep = history.sweeps(st)[0]
        runs = history.runs_of(st, sweep["id"])
        drains = st.drains("node3")
    assert sweep["conclusion"] == "isolated" and json.loads(sweep["slow_nodes"]) == ["node3"]
    confirm = [r for r in runs if r["stage"] == "confirm" and "node3" in expand_hostlist(r["nodes"])]
    assert len(confirm) == 1 and confirm[0]["verdict"] == "slow"
    figure = f"{confirm[0]['busbw_gbps']:.1f} GB/s"
    assert 150 < confirm[0]["busbw_gbps"] < 165  # 400 GB/s x 0.4, as the scenario says
    assert figure in reason and "< 300 GB/s" in reason, reason
    assert drains[0]["outcome"] == "done" and drains[0]["reason"] == reason

    # the all-node run was the slowest member's speed; the healthy pair ran at full speed
    by_stage = {r["stage"]: r for r in runs}
    assert by_stage["all"]["n_nodes"] == 4 and by_stage["all"]["verdict"] == "slow"
    assert any(r["stage"] == "pair" and r["nodes"] == "node[1-2]" and r["verdict"] == "ok" for r in runs)
    # what an admin reads: the report table and progress lines
    assert "node3" in p.stdout and "SLOW" in p.stdout and "isolated" in p.stdout
    assert "submitted" in p.stderr
    # the per-switch table, as `scontrol show topology` groups the nodes: leaf2 holds the one slow (drained) node,
    # and one of two is no reason to suspect the switch
    table = p.stdout[p.stdout.index("\nswitch "):]
    assert table.splitlines()[1].split() == ["switch", "nodes", "ok", "slow", "other", "drained", "hostlist"], table
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:] if line.startswith("leaf")}
    assert rows == {"leaf1": ["leaf1", "2", "2", "0", "0", "0", "node[1-2]"],
                    "leaf2": ["leaf2", "2", "1", "1", "0", "1", "node[3-4]"]}, table
    assert "suspect the switch" not in p.stdout
    print(f"sweep of 4 nodes: {len(runs)} jobs, node3 drained in {took:.1f}s\n{p.stdout}")


def test_sweep_of_a_healthy_fleet_drains_nothing_and_records_a_baseline(site_factory, tmp_path):
    site = site_factory(nodes=3, topology={"leaf1": "node[1-2]", "leaf2": "node3"})
    _configure(site, tmp_path, sweep_method="bisect")
    p = site.gpuguard("nccl", "sweep", "--nodes", "node[1-3]", "--json", timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["conclusion"] == "pass" and report["slow"] == [] and len(report["measurements"]) == 1
    # --json groups the swept nodes by leaf switch too (Slurm's topology)
    assert report["switches"] == {
        "leaf1": {"nodes": "node[1-2]", "count": 2, "ok": 2, "slow": 0, "other": 0, "drained": 0},
        "leaf2": {"nodes": "node3", "count": 1, "ok": 1, "slow": 0, "other": 0, "drained": 0}}, report["switches"]
    for node in site.cluster.node_names:
        assert "DRAIN" not in site.cluster.node_flags(node)
    # every measured size went into the baseline samples, so thresholds can be proposed from the fleet
    b = site.gpuguard("baseline", "show", "--json")
    assert b.returncode == 0, b.stderr
    rows = json.loads(b.stdout)
    largest = max(rows, key=lambda r: r["size_bytes"])
    assert largest["n_nodes"] == 3 and largest["samples"] == 1 and 390 < largest["median"] < 405


def test_a_sweep_job_that_can_never_start_is_named_and_the_sweep_stops_exit_3(site_factory, tmp_path):
    """Issue 29 item 10: a sweep job pending for a reason no waiting clears (here the partition's MaxTime is below
    the sweep's time limit) stops the sweep at once with the reason, exit 3, its jobs
    cancelled, instead of waiting `sweep_job_timeout_s` for nothing."""
    site = site_factory(nodes=2)
    _configure(site, tmp_path, sweep_job_timeout_s=300, sweep_time_limit="00:15:00")
    site.cluster.run(["scontrol", "update", "partitionname=gpu", "maxtime=5"], check=True)
    t0 = time.monotonic()
    p = site.gpuguard("nccl", "sweep", "--partition", "gpu", timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 3, p.stdout + p.stderr
    assert took < 60, f"waited {took:.0f}s on a job that cannot start"
    # Slurm 22.05 names it PartitionConfig or PartitionTimeLimit (the scheduler's later look)
    assert ("PartitionTimeLimit" in p.stderr or "PartitionConfig" in p.stderr) and "never" in p.stderr, p.stderr
    queue = site.cluster.run(["squeue", "-h", "-o", "%i %T"]).stdout.strip()
    assert queue == "", f"the sweep's jobs were left queued: {queue}"
    with history.open_history(str(tmp_path / "fleet.db")) as st:
        sweep = history.sweeps(st)[0]
    assert sweep["conclusion"] == "error", sweep
    for node in site.cluster.node_names:
        assert "DRAIN" not in site.cluster.node_flags(node)
