"""The monitor's alerts (issue 11): it runs on every node of a job, so a job's hang pages once — whichever nodes
see it — and is resolved once; stragglers and thresholds are one message per episode per node/GPU, with a
resolved message when they clear; GPU alerts name the GPU by UUID and serial; at the job's end every open
episode is resolved. Real webhook server, real nvidia-ml-py over the fake libnvidia-ml.so.1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from notify_servers import WebhookServer

from gpuguard.siteconfig import parse_config
from gpuguard.monitor.actions import claim_hang, hang_claim_path, release_hang
from gpuguard.monitor.loop import Monitor

pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")

LINE = (" [2026-03-02 10:00:00] iteration {it:8d}/    1000 | consumed samples: {cs:12d} | elapsed time per "
        "iteration (ms): 850.0 | learning rate: 1.000000E-04 | global batch size:   256 | lm loss: 3.0E+00 |\n")


class Job:
    """N nodes' monitors on one job directory with one shared training log (no NVML here: GPU sampling is off,
    log-based hang detection is what is exercised)."""

    def __init__(self, tmp: Path, hook: WebhookServer, **monitor) -> None:
        self.job_dir = tmp / "job"
        self.log = self.job_dir / "train.log"
        self.log.parent.mkdir(parents=True)
        self.log.write_text(LINE.format(it=10, cs=2560))
        self.cfg = parse_config(yaml.safe_dump({
            "store": {"path": str(tmp / "root-state" / "{node}.db")},
            "sources": {"nvml_library": str(tmp / "no-libnvidia-ml.so.1")},
            "logging": {"syslog": False},
            "notify": {"urls": [hook.url("/pages")]},
            "monitor": {"train_log": str(self.log), "hang_minutes": 1.0, "py_spy": None, "cpu_percent_max": None,
                        "memory_percent_max": None, "disk_percent_max": None, **monitor}}), source="test")
        self.monitors: dict[str, Monitor] = {}

    def monitor(self, node: str, job_id: str = "5150") -> Monitor:
        self.monitors[node] = Monitor(self.cfg, str(self.job_dir), node, job_id, 10.0)
        return self.monitors[node]

    def progress(self, it: int) -> None:
        with self.log.open("a") as f:
            f.write(LINE.format(it=it, cs=it * 256))

    def close(self) -> None:
        for m in self.monitors.values():
            m.close()


@pytest.fixture
def job(tmp_path, hook):
    jobs = []

    def make(**monitor):
        j = Job(tmp_path, hook, **monitor)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.close()


def hang_pages(hook, n, timeout=10.0):
    got = hook.wait_for(n, timeout)
    return [r["body"] for r in got if "job hang" in r["body"]["title"]]


def test_four_nodes_see_the_hang_it_pages_once_and_resolves_once(job, hook):
    j = job()
    nodes = [j.monitor(f"node{i}") for i in range(1, 5)]
    t0 = time.time()
    for m in nodes:
        m.step(now=t0)
    for m in nodes:
        m.step(now=t0 + 40)  # every monitor reports each interval: the claimer sees the others' fresh reports
    fired = [m.step(now=t0 + 70)["fired"] for m in nodes]
    assert sorted(map(tuple, fired)) == [(), (), (), ("monitor.progress:sent",)]
    owner = nodes[[bool(f) for f in fired].index(True)]
    events = [json.loads(e) for e in (j.job_dir / "gpuguard" / "events.jsonl").read_text().splitlines()]
    assert sorted(e["reported"] for e in events) == [False, False, False, True]  # every node recorded it
    # progress again: the owner resolves the job's hang, once; the others stay quiet
    j.progress(20)
    resolved = [m.step(now=t0 + 80)["resolved"] for m in nodes]
    assert sorted(map(tuple, resolved)) == [(), (), (), ("monitor.progress:sent",)]
    got = hang_pages(hook, 2)
    assert [b["status"] for b in got] == ["firing", "resolved"]
    assert {b["dedup_key"] for b in got} == {"gpuguard/job5150/hang"}
    assert "node[1-4]" in got[0]["title"] and f"reported by {owner.node}" in got[0]["message"]
    # the job hangs again later: a new episode, paged once again
    fired = [m.step(now=t0 + 150)["fired"] for m in nodes]
    assert sum(len(f) for f in fired) == 1
    assert [b["status"] for b in hang_pages(hook, 3)] == ["firing", "resolved", "firing"]


def test_the_owner_of_a_hang_gone_another_node_adopts_it_and_resolves_it(job, hook):
    j = job()
    a, b = j.monitor("nodeA"), j.monitor("nodeB")
    t0 = time.time()
    a.step(now=t0)
    assert a.step(now=t0 + 70)["fired"] == ["monitor.progress:sent"]
    # nodeA's monitor dies (its node crashed); nodeB notices the hang only later, when A's report is stale
    b.step(now=t0 + 100)
    later = b.step(now=t0 + 200)
    assert later["fired"] == []  # adopted: the page went out already
    j.progress(20)
    assert b.step(now=t0 + 210)["resolved"] == ["monitor.progress:sent"]
    got = hang_pages(hook, 2)
    assert [(x["status"], x["dedup_key"]) for x in got] == [("firing", "gpuguard/job5150/hang"),
                                                             ("resolved", "gpuguard/job5150/hang")]


def test_a_requeued_attempt_pages_for_its_own_hang(job, hook, monkeypatch):
    j = job()
    first = j.monitor("node1")
    t0 = time.time()
    first.step(now=t0)
    assert first.step(now=t0 + 70)["fired"] == ["monitor.progress:sent"]  # SIGKILLed: nothing resolved it
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    second = j.monitor("node2")
    second.step(now=t0 + 100)
    j.progress(20)  # the requeued attempt resumes (the log's earlier lines were the first attempt's), then hangs
    second.step(now=t0 + 110)
    assert second.step(now=t0 + 200)["fired"] == ["monitor.progress:sent"]


def test_claims_are_exclusive_and_only_the_owner_releases(tmp_path):
    path = hang_claim_path(str(tmp_path), "77", "0")
    alive = {"n1"}
    assert claim_hang(path, "n1", 1.0, alive.__contains__) == "new"
    assert claim_hang(path, "n1", 2.0, alive.__contains__) == "mine"
    assert claim_hang(path, "n2", 2.0, alive.__contains__) == "taken"
    assert not release_hang(path, "n2")
    alive.clear()  # n1's monitor is gone: one of the others adopts the episode (without paging again)
    assert claim_hang(path, "n2", 3.0, alive.__contains__) == "adopted"
    alive.add("n2")
    assert claim_hang(path, "n3", 3.0, alive.__contains__) == "taken"
    # two nodes that both saw n1's claim as stale: one takeover marker per stale claim, one winner
    stale = hang_claim_path(str(tmp_path), "78", "0")
    assert claim_hang(stale, "n1", 1.0, alive.__contains__) == "new"
    Path(f"{stale}.takeover-n1-1.0").write_text("{}")  # n4 got there first
    assert claim_hang(stale, "n5", 2.0, set().__contains__) == "taken"
    assert release_hang(path, "n2") and not Path(path).exists()
    assert claim_hang(path, "n3", 4.0, alive.__contains__) == "new"
    assert hang_claim_path(str(tmp_path), "77/../x", "1").startswith(str(tmp_path) + "/hang-77_.._x-r1")


def test_stragglers_and_thresholds_resolve_after_they_stay_clear(tmp_path, hook):
    """Per node/GPU, once per episode; resolved after straggler_samples clear samples (no flapping pages);
    the GPU's UUID and serial from NVML in the message; at the job's end, open episodes are resolved."""
    from gpuguard.monitor.sampler import GpuSampler
    from gpuguard.simulate.build import build_fake_nvml

    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    busy = {"utilization_pct": 97, "throttle": ["sw_power_cap"], "power_w": 650, "temperature_c": 62}
    (scenarios / "node2.yaml").write_text(yaml.safe_dump({"instance_type": "p5.48xlarge", "gpus": {
        "defaults": busy, "overrides": {3: {"throttle": ["hw_slowdown", "sw_power_cap"]}}}}))
    fake = str(build_fake_nvml())
    cfg = parse_config(yaml.safe_dump({
        "store": {"path": str(tmp_path / "state" / "{node}.db")},
        "simulation": {"scenario_dir": str(scenarios), "workdir": str(tmp_path / "sim"), "fake_nvml": fake},
        "logging": {"syslog": False}, "notify": {"urls": [hook.url("/pages")]},
        "monitor": {"train_log": None, "straggler_samples": 2, "py_spy": None, "cpu_percent_max": None,
                    "memory_percent_max": None, "disk_percent_max": None}}), source="test")
    mon = Monitor(cfg, str(tmp_path / "job"), "node2", "5150", 10.0)

    def throttle(mask: str) -> None:  # the driver's view changes: a new NVML session sees it
        mon.gpus.close()
        library, env = mon._nvml_source()
        with open(env["GPUGUARD_FAKE_NVML_FILE"], "a") as f:
            f.write(f"gpu.3.clocks_event_reasons={mask}\n")
        mon.gpus = GpuSampler(None, library, env)

    try:
        t0 = time.time()
        assert mon.step(now=t0)["fired"] == []
        assert mon.step(now=t0 + 10)["fired"] == ["monitor.gpu_throttle:sent"]
        page = hook.wait_for(1)[0]["body"]
        uuid = mon.gpus.nv.nvmlDeviceGetUUID(dict(mon.gpus.handles)[3])
        serial = mon.gpus.nv.nvmlDeviceGetSerial(dict(mon.gpus.handles)[3])
        assert f"GPU 3 uuid={uuid} serial={serial} pci=" in page["message"]
        assert page["dedup_key"] == "gpuguard/node2/straggler/monitor.gpu_throttle/gpu3/job5150"
        throttle("0x4")  # the throttling stops (SW power cap only)
        first_clear = mon.step(now=t0 + 20)
        assert first_clear["alerts"] == [] and first_clear["resolved"] == []  # one clear sample is not enough
        assert mon.step(now=t0 + 30)["resolved"] == ["monitor.gpu_throttle:sent"]
        resolved = hook.wait_for(2)[1]["body"]
        assert (resolved["status"], resolved["dedup_key"]) == ("resolved", page["dedup_key"])
        assert "cleared: GPU 3 throttled" in resolved["message"]
        # it comes back, and the job ends while it lasts: the monitor resolves what it leaves open
        throttle("0xc")
        mon.step(now=t0 + 40)
        assert mon.step(now=t0 + 50)["fired"] == ["monitor.gpu_throttle:sent"]
        assert mon.resolve_all("no longer monitored: the job ended") == ["monitor.gpu_throttle:sent"]
        last = hook.wait_for(4)[3]["body"]
        assert last["status"] == "resolved" and "the job ended" in last["message"]
    finally:
        mon.close()


def test_without_py_spy_no_dump_is_tried_and_the_page_points_at_none(job, hook, capfd):
    """Issue 29 item 4: `monitor.py_spy: null` means never dump stacks: no 'py-spy not available (pip install ...)'
    line, no stack-dump claim in the page; two nodes on one shared log: the page says it cannot tell which is
    stuck and names both nodes, not the one that claimed the hang."""
    j = job()
    a, b = j.monitor("node1"), j.monitor("node2")
    t0 = time.time()
    for now in (t0, t0 + 40):
        a.step(now=now)
        b.step(now=now)
    assert a.step(now=t0 + 70)["fired"] == ["monitor.progress:sent"]
    assert b.step(now=t0 + 70)["fired"] == []
    page = hang_pages(hook, 1)[0]
    assert page["title"] == "gpuguard: job hang node[1-2] monitor.progress", page["title"]
    assert "cannot tell which node is stuck" in page["message"] and "reported by node1" in page["message"]
    assert "stacks:" not in page["message"] and "stack_dump" not in page["message"]
    err = capfd.readouterr().err
    assert "py-spy" not in err and "pip install" not in err, err
    assert not list((j.job_dir / "gpuguard" / "stacks").iterdir())


def test_py_spy_configured_but_missing_is_said_once_and_no_dump_is_claimed(job, hook, capfd):
    j = job(py_spy="no-such-py-spy")
    m = j.monitor("node1")
    t0 = time.time()
    m.step(now=t0)
    assert m.step(now=t0 + 70)["fired"] == ["monitor.progress:sent"]
    j.progress(20)
    m.step(now=t0 + 80)
    assert m.step(now=t0 + 150)["fired"] == ["monitor.progress:sent"]  # a second hang
    err = capfd.readouterr().err
    assert err.count("py-spy (no-such-py-spy) not found") == 1, err
    pages = [p for p in hang_pages(hook, 3) if p["status"] == "firing"]
    assert len(pages) == 2
    for p in pages:
        assert "no stack dump: py-spy (no-such-py-spy) not found" in p["message"]
        assert "dumped to" not in p["message"] and "look at the Python stack dumps" not in p["message"]
    assert not list((j.job_dir / "gpuguard" / "stacks").iterdir())
