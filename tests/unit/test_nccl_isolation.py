"""The sweep's isolation logic (pure, with a simulated fabric), thresholds, hostlists, node selection, job
rendering and the Slurm runner's handling of sbatch/scontrol answers (fake command runner)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

import pytest

from gpuguard.nccl.fleet import format_report, run_fleet_sweep
from gpuguard.slurm.hostlist import HostlistError, compress_hostlist, expand_hostlist
from gpuguard.nccl.isolate import Measurement, drain_reason, isolate
from gpuguard.nccl.sweep import JobSpec, SlurmRunner, SweepError, parse_sinfo_nodes, render_job, threshold_resolver
from gpuguard.slurm.reason import parse_reason
from gpuguard.slurm.client import NodeState


class Fabric:
    """A simulated fleet: every node has a bandwidth; a run is as fast as its slowest member (or fails)."""

    def __init__(self, speeds: dict[str, float], threshold: float = 300.0, failing: frozenset[str] = frozenset()):
        self.speeds = speeds
        self.threshold = threshold
        self.failing = failing
        self.calls: list[tuple[str, list[tuple[str, ...]]]] = []

    def __call__(self, groups, stage):
        self.calls.append((stage, list(groups)))
        out = []
        for g in groups:
            m = Measurement(nodes=tuple(g), stage=stage, threshold_gbps=self.threshold, job_id=str(len(self.calls)))
            if self.failing & set(g):
                m.error = "NCCL failure"
            else:
                m.busbw_gbps, m.size_bytes = min(self.speeds[n] for n in g), 1 << 30
            out.append(m)
        return out


def nodes(n: int) -> dict[str, float]:
    return {f"node{i}": 400.0 for i in range(1, n + 1)}


@pytest.mark.parametrize("method", ["pairwise", "bisect"])
@pytest.mark.parametrize("n,slow", [(4, ["node3"]), (8, ["node2", "node7"]), (5, ["node5"]), (16, ["node11"]),
                                    (3, ["node1"])])
def test_isolation_finds_exactly_the_slow_nodes(method, n, slow):
    speeds = nodes(n)
    for s in slow:
        speeds[s] = 150.0
    fab = Fabric(speeds)
    out = isolate(list(speeds), fab, method=method)
    assert out.conclusion == "isolated" and sorted(out.slow) == sorted(slow)
    for node in speeds:
        assert out.verdicts[node].status == ("slow" if node in slow else "ok"), (node, out.verdicts[node])
    for s in slow:
        v = out.verdicts[s]
        # convicted in a 2-node run whose partner is a node proven good
        assert v.partner and out.verdicts[v.partner].status == "ok" and v.busbw_gbps == 150.0


def test_healthy_fleet_is_one_job():
    fab = Fabric(nodes(6))
    out = isolate(list(fab.speeds), fab)
    assert out.conclusion == "pass" and len(fab.calls) == 1 and not out.slow


def test_pairwise_runs_disjoint_pairs_concurrently():
    speeds = nodes(8)
    speeds["node6"] = 100.0
    fab = Fabric(speeds)
    isolate(list(speeds), fab)
    stages = [s for s, _ in fab.calls]
    assert stages == ["all", "pair", "confirm"]
    assert fab.calls[1][1] == [("node1", "node2"), ("node3", "node4"), ("node5", "node6"), ("node7", "node8")]


def test_bisection_recurses_into_the_slow_half_only():
    speeds = nodes(16)
    speeds["node11"] = 100.0
    fab = Fabric(speeds)
    isolate(list(speeds), fab, method="bisect")
    bisect_groups = [g for s, gs in fab.calls if s == "bisect" for g in gs]
    assert ("node1", "node2", "node3", "node4", "node5", "node6", "node7", "node8") in bisect_groups
    assert all("node11" in g or len(g) == 8 or set(g) <= {f"node{i}" for i in range(9, 17)} for g in bisect_groups)


def test_every_pair_slow_is_a_fabric_problem_and_drains_nothing():
    fab = Fabric({n: 120.0 for n in nodes(6)})
    out = isolate(list(fab.speeds), fab)
    assert out.conclusion == "fabric" and out.slow == []
    assert {v.status for v in out.verdicts.values()} == {"unknown"}


def test_too_many_slow_nodes_is_not_drained():
    speeds = nodes(8)
    for i in (1, 2, 3, 5, 7):
        speeds[f"node{i}"] = 100.0
    out = isolate(list(speeds), Fabric(speeds), max_drain_fraction=0.5)
    assert out.conclusion == "fabric" and out.slow == [] and "nothing drained" in out.message


def test_cross_pairing_finds_good_nodes_when_every_pair_had_a_slow_member():
    speeds = nodes(4)
    speeds["node1"] = speeds["node3"] = 100.0  # pairs (1,2) and (3,4) both slow
    out = isolate(list(speeds), Fabric(speeds), max_drain_fraction=0.5)
    assert sorted(out.slow) == ["node1", "node3"] and out.verdicts["node2"].status == "ok"


def test_failed_runs_leave_nodes_undecided_never_drained():
    speeds = nodes(4)
    out = isolate(list(speeds), Fabric(speeds, failing=frozenset({"node4"})))
    assert out.slow == [] and out.verdicts["node4"].status == "unknown" and out.conclusion == "inconclusive"


def test_slow_all_run_but_fast_pairs_is_scale_dependent():
    class ScaleFabric(Fabric):
        def __call__(self, groups, stage):
            ms = super().__call__(groups, stage)
            for m in ms:
                if len(m.nodes) > 2:
                    m.busbw_gbps = 200.0
            return ms

    out = isolate(list(nodes(4)), ScaleFabric(nodes(4)))
    assert out.conclusion == "inconclusive" and out.slow == [] and "scale-dependent" in out.message


def test_wrong_results_convict_like_slowness():
    speeds = nodes(4)

    class Corrupt(Fabric):
        def __call__(self, groups, stage):
            ms = super().__call__(groups, stage)
            for m in ms:
                if "node2" in m.nodes:
                    m.wrong = 7
            return ms

    out = isolate(list(speeds), Corrupt(speeds))
    assert out.slow == ["node2"]
    reason = drain_reason(out.verdicts["node2"])
    assert "7 wrong values" in reason and parse_reason(reason).keyword == "NCCL"


def test_drain_reason_carries_the_figure_and_fits():
    speeds = nodes(4)
    speeds["node3"] = 161.27
    out = isolate(list(speeds), Fabric(speeds))
    reason = drain_reason(out.verdicts["node3"])
    p = parse_reason(reason)
    assert p.check_id == "nccl.sweep" and p.keyword == "NCCL" and p.context == "sweep"
    assert "161.3 GB/s < 300 GB/s" in reason and "with node1" in reason and len(reason) <= 120


class FakeSlurm:
    def __init__(self, states: Optional[dict[str, NodeState]] = None):
        self.drained: dict[str, str] = {}
        self.states = states or {}

    def get_node(self, name):
        return self.states.get(name, NodeState(name, frozenset({"IDLE"})))

    def drain(self, name, reason):
        self.drained[name] = reason

    def undrain(self, name):
        self.drained.pop(name, None)


def test_fleet_sweep_drains_through_ownership_rules_and_records(tmp_path):
    from gpuguard.nccl import history

    speeds = nodes(4)
    speeds["node2"] = speeds["node4"] = 90.0
    slurm = FakeSlurm({"node4": NodeState("node4", frozenset({"IDLE", "DRAIN"}), reason="admin: bad cable")})
    with history.open_history(str(tmp_path / "h.db")) as st:
        rec = run_fleet_sweep(list(speeds), Fabric(speeds), store=st, slurm_client=slurm, profile="p5.48xlarge")
        runs = history.runs_of(st, rec.sweep_id)
        samples = history.samples(st, profile="p5.48xlarge")
        drains = {d["node"]: d for d in st.drains()}
    assert list(slurm.drained) == ["node2"] and rec.drained == ["node2"]
    assert drains["node4"]["outcome"] == "foreign"  # someone else's drain is never overwritten
    assert [r["stage"] for r in runs][0] == "all" and len(samples) == 0  # Fabric measurements carry no table
    report = format_report(rec, "gpu")
    assert "node2" in report and "SLOW" in report and "-> done" in report and "-> foreign" in report
    assert "switch" not in report  # no topology: no per-switch table
    from gpuguard.nccl.fleet import per_switch
    from gpuguard.slurm.topology import parse_topology

    topo = parse_topology("SwitchName=leaf7 Level=0 LinkSpeed=1 Nodes=node[1-2]\n"
                          "SwitchName=leaf8 Level=0 LinkSpeed=1 Nodes=node[3-4]\n")
    by_switch = format_report(rec, "gpu", switches=topo)
    assert "leaf7" in by_switch and "leaf8" in by_switch
    groups = per_switch(rec.outcome, topo)
    assert groups["leaf7"]["count"] == 2 and groups["leaf7"]["slow"] == 1 and groups["leaf7"]["drained"] == 1
    assert groups["leaf8"]["nodes"] == "node[3-4]"


def test_no_drain_reports_only():
    speeds = nodes(2)
    speeds["node2"] = 10.0
    slurm = FakeSlurm()
    rec = run_fleet_sweep(["node1", "node2", "node3"], Fabric({**speeds, "node3": 400.0}), slurm_client=slurm,
                          drain=False)
    assert slurm.drained == {} and rec.outcome.verdicts["node2"].drain["outcome"] == "skipped"


# --------------------------------------------------------------------------- thresholds, hostlists, sinfo


def test_threshold_resolution_order():
    t = threshold_resolver(300.0, {"2": 380, 16: 350}, baseline=lambda n: 999.0)
    assert t(2) == 380 and t(8) == 380 and t(16) == 350 and t(64) == 350
    assert threshold_resolver(300.0, {})(4) == 300.0
    assert threshold_resolver(None, {}, baseline=lambda n: 123.0)(4) == 123.0
    assert threshold_resolver(None, {})(4) is None
    with pytest.raises(SweepError, match="sweep_busbw_by_nodes"):
        threshold_resolver(None, {"two": 380})


def test_hostlists():
    assert expand_hostlist("node[1-3,5],gpu-a[08-10]") == ["node1", "node2", "node3", "node5", "gpu-a08", "gpu-a09",
                                                           "gpu-a10"]
    assert compress_hostlist(["node1", "node2", "node3", "node5"]) == "node[1-3,5]"
    assert compress_hostlist(["a09", "a10"]) == "a[09-10]"
    assert expand_hostlist(compress_hostlist(["n7", "n1", "n2"])) == ["n1", "n2", "n7"]
    for bad in ("node[1-", "node[3-1]", "no de1", "node;rm"):
        with pytest.raises(HostlistError):
            expand_hostlist(bad)


def test_sinfo_skips_nodes_that_must_not_be_swept():
    usable, skipped = parse_sinfo_nodes("node1 idle\nnode2 drain\nnode3 mix\nnode4 down*\nnode5 idle~\n"
                                        "node6 alloc\nnode7 maint\nnode1 idle\n")
    assert usable == ["node1", "node3", "node6"]
    assert set(skipped) == {"node2", "node4", "node5", "node7"}


# --------------------------------------------------------------------------- rendering and the runner


def _values(tmp_path: Path) -> dict:
    return {"job_name": "gg-nccl-all", "nodes": 2, "nodelist": "node[1-2]", "partition": "gpu", "gpus_per_node": 8,
            "binary": "/opt/nccl tests/all_reduce_perf", "min_bytes": "1073741824", "max_bytes": "17179869184",
            "iters": 20, "output": str(tmp_path / "001-all.out"), "time_limit": "00:15:00", "mpi": "pmix",
            "job_root": str(tmp_path / "jobs")}


def test_job_renders_through_the_templates_api(tmp_path):
    script, which = render_job(_values(tmp_path))
    assert which == "nccl-tests.sbatch.j2"
    assert "#SBATCH --nodes=2" in script and "node[1-2]" in script and "--exclusive" in script
    assert "'/opt/nccl tests/all_reduce_perf' -b 1073741824 -e 17179869184" in script  # quoted, never a shell word split


def _answers(tmp_path, outputs: dict[str, str], states: dict[str, list[str]]):
    calls = []
    counter = iter(range(1, 100))

    def run(argv, timeout):
        calls.append(list(argv))
        if argv[0] == "sbatch":
            job = str(next(counter))
            script = Path(argv[-1]).read_text()
            out = script.split("--output=")[1].splitlines()[0].strip("'")
            if job in outputs:
                Path(out).write_text(outputs[job])
            return subprocess.CompletedProcess(argv, 0, f"{job}\n", "")
        if argv[:3] == ["scontrol", "show", "job"]:
            job = argv[-1]
            seq = states.get(job, ["COMPLETED"])
            state = seq.pop(0) if len(seq) > 1 else seq[0]
            return subprocess.CompletedProcess(argv, 0, f"JobId={job} JobName=x UserId=root(0) GroupId=root(0) "
                                               f"JobState={state} Reason=None\n", "")
        return subprocess.CompletedProcess(argv, 0, "", "")

    return run, calls


def test_runner_submits_waits_and_parses(tmp_path):
    table = (Path(__file__).resolve().parents[1] / "fixtures" / "nccl" / "gb200_nvl72_modern_no_prefix.txt").read_text()
    run, calls = _answers(tmp_path, {"1": table, "2": "node2: Test NCCL failure common.cu:1005 'unhandled system error'\n"},
                          {"1": ["PENDING", "RUNNING", "COMPLETED"], "2": ["FAILED"]})
    runner = SlurmRunner(JobSpec(partition="gpu"), str(tmp_path / "w"), lambda n: 800.0, poll_s=0.01, run=run)
    ok, bad = runner([("node1", "node2"), ("node3", "node4")], "pair")
    assert ok.job_id == "1" and ok.job_state == "COMPLETED" and ok.busbw_gbps == 834.57 and ok.verdict == "ok"
    assert ok.size_bytes == 8589934592
    assert bad.verdict == "error" and "no result table" in bad.error and "Test NCCL failure" in bad.error
    assert [c[0] for c in calls].count("sbatch") == 2
    assert runner.template_used == "nccl-tests.sbatch.j2"


def test_runner_cancels_jobs_that_never_finish(tmp_path):
    run, calls = _answers(tmp_path, {}, {"1": ["PENDING"]})
    runner = SlurmRunner(JobSpec(partition="gpu"), str(tmp_path / "w"), lambda n: 1.0, poll_s=0.01,
                         job_timeout_s=0.05, run=run)
    (m,) = runner([("node1", "node2")], "all")
    assert m.verdict == "error" and "did not finish" in m.error and ["scancel", "1"] in calls


def test_runner_refuses_hostile_names(tmp_path):
    with pytest.raises(SweepError):
        SlurmRunner(JobSpec(partition="gpu\n#SBATCH --uid=0"), str(tmp_path), lambda n: 1.0)
    runner = SlurmRunner(JobSpec(partition="gpu"), str(tmp_path), lambda n: 1.0)
    with pytest.raises(SweepError):
        runner.submit(("node1", "node2;reboot"), "pair")
    with pytest.raises(SweepError):
        SlurmRunner(JobSpec(partition="gpu", time_limit="soon"), str(tmp_path), lambda n: 1.0)


def test_runner_reports_sbatch_refusal(tmp_path):
    def run(argv, timeout):
        if argv[0] == "sbatch":
            return subprocess.CompletedProcess(argv, 1, "", "sbatch: error: Invalid partition name specified\n")
        return subprocess.CompletedProcess(argv, 0, "", "")

    runner = SlurmRunner(JobSpec(partition="nope"), str(tmp_path), lambda n: 1.0, run=run)
    (m,) = runner([("node1", "node2")], "all")
    assert m.job_id is None and "Invalid partition" in m.error
