"""The pre-flight's floor when config gives none (the baseline proposal for the job's node count at the pre-flight's
largest size, from the NCCL history in a real SQLite store) and the nodes' own history (a passed pre-flight records
its all-node bus bandwidth as a `preflight` sample; a slow, too-slow or hung one never does), judged through the
pre-flight's own blame with scripted fabrics as tests/unit/test_preflight.py does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import pytest
from clirun import gpuguard

from gpuguard.nccl import history
from gpuguard.nccl.baseline import Proposal, floor_proposal, propose
from gpuguard.preflight.blame import run_blame
from gpuguard.preflight.floor import Floor, largest_size, pass_sample, preflight_floor
from gpuguard.preflight.history import load_proposals, record_sample
from gpuguard.preflight.judge import Step, result_line, round_measurements, summary_line
from gpuguard.siteconfig import parse_config

NODES = ["node1", "node2", "node3", "node4"]
SIZE = 4 << 20  # the pre-flight's largest size by default (64 KiB * 4^3)
ALLOWANCE = 15.0


def prop(n: int, size: int, thr: Optional[float], samples: int = 6, profile: str = "generic",
         backend: str = "gloo") -> Proposal:
    return Proposal(profile, n, size, samples, 2.0, 0.05, 1.9, 1.8, 2.1, thr, backend=backend)


def fabric(floor: Callable[[int], Optional[float]], slow=(), hung=(), bw=2.0, stopped=False):
    """Groups run at `bw` GB/s in 1 s, 0.2 GB/s when they hold a `slow` node; `hung` nodes never finish;
    `stopped`: every run stopped by load (nothing beside it finished)."""
    def step(g):
        if stopped:
            return Step(g, "", None, True, ALLOWANCE)
        if set(g) & set(hung):
            return Step(g, "", None, True, ALLOWANCE)
        b = 0.2 if set(g) & set(slow) else bw
        return Step(g, result_line([SIZE // 4, SIZE], [b * 2, b], "gloo", len(g)), 0, False, 1.0)

    def measure(groups, stage):
        return round_measurements([step(g) for g in groups], stage, floor, ALLOWANCE, False)
    return measure


@pytest.fixture
def cfg(tmp_path: Path):
    text = (f"store: {{path: '{tmp_path}/state/{{node}}.db'}}\nnccl: {{baseline_min_samples: 5}}\n"
            "logging: {syslog: false}\n")
    (tmp_path / "config.yaml").write_text(text)
    return parse_config(text)


def seed(tmp_path: Path, values: list[float], n: int = 4, size: int = SIZE, source: str = "preflight",
         backend: str = "gloo") -> None:
    with history.open_history(str(tmp_path / "state" / "fleet.db")) as st:
        history.record_samples(st, [("generic", n, size, v, "node[1-4]", source, None, backend) for v in values])


def test_the_largest_size_is_the_workers_last():
    assert largest_size(65536, 4194304) == SIZE and largest_size(65536, 5000000) == SIZE
    assert largest_size(65536, 262144) == 262144


def test_config_wins_then_the_baseline_for_the_count_then_the_nearest_smaller_then_none():
    props = [prop(2, SIZE, 1.5), prop(4, SIZE, 1.8), prop(8, 16 << 30, 300.0), prop(16, SIZE, None, samples=2)]
    f = preflight_floor(None, {}, props, "generic", SIZE, "gloo")
    assert (f.resolve(4), f.describe(4)) == (1.8, "floor 1.8 GB/s (baseline 6 gloo samples)")
    # 8 nodes: only a sweep-sized proposal (16 GiB) there, never a pre-flight floor; the 4-node one instead
    assert (f.resolve(8), f.describe(8)) == (1.8, "floor 1.8 GB/s (baseline 6 gloo samples of 4-node runs)")
    assert f.resolve(16) == 1.8  # too few samples at 16: the nearest smaller count with a proposal
    assert f.resolve(3) == 1.5 and f.resolve(2) == 1.5
    cfg_floor = preflight_floor(None, {2: 0.5, 8: 0.7}, props, "generic", SIZE, "gloo")
    assert (cfg_floor.resolve(4), cfg_floor.describe(4)) == (0.5, "floor 0.5 GB/s (config)")
    flag = preflight_floor(0.0, {}, props, "generic", SIZE, "gloo", given="--floor")
    assert flag.describe(4) == "floor 0 GB/s (--floor)" and flag.resolve(4) == 0.0
    other = preflight_floor(None, {}, props, "p5.48xlarge", SIZE, "gloo")  # another profile's history is not ours
    assert (other.resolve(4), other.describe(4)) == (None, "no floor (only a hang or failure judged)")


def test_pairs_get_the_job_sizes_floor_when_the_history_has_only_job_sizes():
    f = preflight_floor(None, {}, [prop(4, SIZE, 1.8)], "generic", SIZE, "gloo")
    assert f.resolve(2) == 1.8 and f.describe(2) == "floor 1.8 GB/s (baseline 6 gloo samples of 4-node runs)"
    # the sweep's lookup: a count's largest measured size, never a larger count's proposal
    sweep = [prop(2, 16 << 30, 300.0, backend="nccl-tests")]
    assert floor_proposal(sweep, "generic", 4, 1 << 30, any_size=True).threshold_gbps == 300.0
    assert floor_proposal(sweep, "generic", 4, 1 << 30) is None
    assert floor_proposal([prop(4, SIZE, 1.8)], "generic", 2, SIZE) is None


def test_a_slow_node_passes_without_a_floor_and_is_blamed_against_the_baseline_from_the_store(cfg, tmp_path):
    props, err = load_proposals(cfg, "generic")
    assert (props, err) == ([], None) and not (tmp_path / "state" / "fleet.db").exists()  # reading creates nothing
    none = preflight_floor(None, {}, props, "generic", SIZE, "gloo")
    b = run_blame(NODES, fabric(none.resolve, slow=["node3"]))
    assert b.blamed == [] and b.outcome.conclusion == "pass"
    seed(tmp_path, [2.0, 2.1, 1.95, 2.05, 2.0, 1.98])
    seed(tmp_path, [400.0] * 6, size=16 << 30)  # the sweep's size: not the pre-flight's floor
    props, err = load_proposals(cfg, "generic")
    f = preflight_floor(None, {}, props, "generic", SIZE, "gloo")
    assert err is None and f.describe(4) == "floor 1.84 GB/s (baseline 6 gloo samples)"
    b = run_blame(NODES, fabric(f.resolve, slow=["node3"]))
    assert b.blamed == ["node3"], b.outcome.to_dict()
    assert "busbw 0.2 GB/s vs 2 with peers" in b.nodes_to_drain["node3"]
    assert run_blame(NODES, fabric(f.resolve)).outcome.conclusion == "pass"  # a healthy fabric still passes


def test_an_unreadable_store_gives_no_floor_and_says_so(cfg, tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "fleet.db").mkdir()  # not a file SQLite can open
    props, err = load_proposals(cfg, "generic")
    assert props == [] and err and err.startswith("baseline not read:")
    assert record_sample(cfg, ("generic", 4, SIZE, 2.0, "node[1-4]", "preflight", "7", "gloo")).startswith(
        "sample not recorded:")


def test_only_a_passed_preflight_becomes_a_sample():
    floor = preflight_floor(1.0, {}, [], "generic", SIZE, "gloo").resolve
    passed = run_blame(NODES, fabric(floor))
    assert pass_sample(passed.outcome, NODES, "generic", "42", "gloo") == (
        "generic", 4, SIZE, 2.0, "node[1-4]", "preflight", "42", "gloo")
    for label, b in (("slow", run_blame(NODES, fabric(floor, slow=["node3"]))),
                     ("uniformly slow", run_blame(NODES, fabric(floor, bw=0.5))),
                     ("hung", run_blame(NODES, fabric(floor, hung=["node2"]))),
                     ("too slow to judge", run_blame(NODES, fabric(floor, stopped=True)))):
        assert pass_sample(b.outcome, NODES, "generic", "42", "gloo") is None, (label, b.outcome.to_dict())


def test_passed_preflights_seed_the_floor_a_later_preflight_is_judged_against(cfg, tmp_path):
    """The nodes' own history: five passed pre-flights without a floor, then `baseline show/propose` lists them as
    `preflight` samples, and the sixth pre-flight gets its floor from them and blames the slow node."""
    for i, bw in enumerate([2.0, 2.1, 1.9, 2.0, 2.05]):
        props, _ = load_proposals(cfg, "generic")
        f = preflight_floor(None, {}, props, "generic", SIZE, "gloo")
        assert f.resolve(4) is None, i  # fewer than baseline_min_samples: still no floor
        b = run_blame(NODES, fabric(f.resolve, bw=bw))
        sample = pass_sample(b.outcome, NODES, "generic", str(100 + i), "gloo")
        assert sample is not None and record_sample(cfg, sample) == "sample recorded"
    # a slow pre-flight judged against that floor adds nothing
    props, _ = load_proposals(cfg, "generic")
    f = preflight_floor(None, {}, props, "generic", SIZE, "gloo")
    assert f.describe(4) == "floor 1.78 GB/s (baseline 5 gloo samples)"  # 2.0 - 3 * 1.4826 * 0.05
    b = run_blame(NODES, fabric(f.resolve, slow=["node3"]))
    assert b.blamed == ["node3"] and pass_sample(b.outcome, NODES, "generic", "200", "gloo") is None
    with history.open_history(str(tmp_path / "state" / "fleet.db")) as st:
        rows = history.samples(st, profile="generic")
    assert [(r["source"], r["job_id"], r["size_bytes"], r["backend"]) for r in rows] == [
        ("preflight", str(100 + i), SIZE, "gloo") for i in range(5)]
    env = {"GPUGUARD_CONFIG": str(tmp_path / "config.yaml"), "PATH": "/usr/bin:/bin"}
    p = gpuguard("baseline", "show", env=env)
    assert p.returncode == 0 and "preflight 5" in p.stdout, p.stdout
    p = gpuguard("baseline", "propose", "--json", env=env)
    (row,) = json.loads(p.stdout)
    assert (row["n_nodes"], row["size_bytes"], row["samples"], row["sources"]) == (4, SIZE, 5, "preflight 5")
    assert row["threshold_gbps"] == pytest.approx(1.7776, abs=1e-4)


def test_the_job_line_says_where_the_floor_came_from():
    f: Floor = preflight_floor(None, {}, [prop(4, SIZE, 1.8)], "generic", SIZE, "gloo")
    line = summary_line(NODES, 6.2, "pass", [], "passed, busbw 2 GB/s", 3.0, [("all", 0.9)],
                        [f.describe(4), "sample recorded"])
    assert line.endswith("passed, busbw 2 GB/s [floor 1.8 GB/s (baseline 6 gloo samples), sample recorded, "
                         "workers up in 3.0s, rounds all 0.9s]"), line
    assert "[no floor (only a hang or failure judged)]" in summary_line(
        NODES, 1.0, "pass", [], "passed", notes=[preflight_floor(None, {}, [], "generic", SIZE, "gloo").describe(4)])


def test_a_cpu_preflights_small_figures_keep_their_floor():
    """gloo on CPU nodes reads hundredths of a GB/s: the proposal must not round its floor to 0 or up to the median."""
    (p,) = propose([{"profile": "g", "n_nodes": 4, "size_bytes": SIZE, "busbw_gbps": v, "source": "preflight"}
                    for v in (0.05, 0.05, 0.05, 0.05, 0.05)])
    assert p.threshold_gbps == pytest.approx(0.0475) and p.median == 0.05
    (p,) = propose([{"profile": "g", "n_nodes": 4, "size_bytes": SIZE, "busbw_gbps": v, "source": "preflight"}
                    for v in (0.0052, 0.0053, 0.0054, 0.0052, 0.0053)])
    assert 0.0045 < p.threshold_gbps < 0.0052


def test_proposals_say_where_their_samples_came_from():
    rows = [{"profile": "g", "n_nodes": 2, "size_bytes": 1, "busbw_gbps": 1.0, "source": s}
            for s in ("measure", "preflight", "preflight")]
    (p,) = propose(rows, min_samples=1)
    assert p.sources == "measure 1, preflight 2"


# --------------------------------------------------------------------------- one backend's samples only (issue 28)


def test_a_floor_comes_only_from_samples_of_the_preflights_own_collective(cfg, tmp_path):
    """nccl-tests and torch's gloo read bus bandwidths that are not comparable: six nccl-tests samples at the
    pre-flight's size give an nccl-tests pre-flight its floor and a gloo pre-flight none, and the other way round;
    the sweep's floor never comes from a pre-flight's torch samples."""
    seed(tmp_path, [2.0, 2.1, 1.95, 2.05, 2.0, 1.98], backend="nccl-tests")
    seed(tmp_path, [0.05, 0.051, 0.049, 0.05, 0.05, 0.052], backend="gloo")
    props, _ = load_proposals(cfg, "generic")
    assert sorted((p.backend, p.samples) for p in props) == [("gloo", 6), ("nccl-tests", 6)]
    tests_floor = preflight_floor(None, {}, props, "generic", SIZE, "nccl-tests")
    gloo_floor = preflight_floor(None, {}, props, "generic", SIZE, "gloo")
    nccl_floor = preflight_floor(None, {}, props, "generic", SIZE, "nccl")
    assert tests_floor.describe(4) == "floor 1.84 GB/s (baseline 6 nccl-tests samples)"
    assert gloo_floor.resolve(4) == pytest.approx(0.047, abs=1e-3) and nccl_floor.resolve(4) is None
    # a slow node against the gloo floor: blamed; the same gloo figures would all be "slow" against nccl-tests'
    assert run_blame(NODES, fabric(gloo_floor.resolve, bw=0.05)).outcome.conclusion == "pass"
    assert floor_proposal(props, "generic", 4, SIZE, any_size=True, backend="nccl-tests").threshold_gbps == \
        pytest.approx(1.84, abs=0.01)


def test_a_passed_preflight_records_its_backend_and_show_lists_it(cfg, tmp_path):
    floor = preflight_floor(1.0, {}, [], "generic", SIZE, "nccl-tests").resolve
    sample = pass_sample(run_blame(NODES, fabric(floor)).outcome, NODES, "generic", "9", "nccl-tests")
    assert sample is not None and sample[-1] == "nccl-tests" and record_sample(cfg, sample) == "sample recorded"
    env = {"GPUGUARD_CONFIG": str(tmp_path / "config.yaml"), "PATH": "/usr/bin:/bin"}
    p = gpuguard("baseline", "show", "--json", env=env)
    assert [(r["backend"], r["sources"]) for r in json.loads(p.stdout)] == [("nccl-tests", "preflight 1")]
    assert "nccl-tests" in gpuguard("baseline", "show", env=env).stdout
