"""`gpuguard monitor` over simulated GPUs (the real nvidia-ml-py binding over the fake libnvidia-ml.so.1), with
alerts delivered to a real local webhook server: a throttled GPU is a straggler, a stalled training log is a
hang (stacks dumped with py-spy, one node reports it, optional requeue), resource thresholds, metrics, cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from notify_servers import WebhookServer

from gpuguard.siteconfig import parse_config
from gpuguard.monitor.loop import Monitor
from gpuguard.templates.jobfiles import requeue_asked
from gpuguard.simulate.build import build_fake_nvml
from gpuguard.simulate.scenario import materialize

pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")

BUSY = {"utilization_pct": 97, "throttle": ["sw_power_cap"], "power_w": 650, "temperature_c": 62}
MEGATRON = (" [2026-03-02 10:00:{s:02d}] iteration {it:8d}/    1000 | consumed samples: {cs:12d} | elapsed time per "
            "iteration (ms): {ms:.1f} | learning rate: 1.000000E-04 | global batch size:   256 | lm loss: "
            "{loss:.6E} | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan "
            "iterations:   0 |\n")


class Site:
    """Simulated nodes sharing a job directory (what the torchrun template gives the sidecar on each node)."""

    def __init__(self, tmp: Path, hook: WebhookServer, **monitor) -> None:
        self.tmp = tmp
        self.job_dir = tmp / "job"
        self.scenarios = tmp / "scenarios"
        self.scenarios.mkdir()
        self.fake = str(build_fake_nvml())
        self.config = {
            "store": {"path": str(tmp / "state" / "{node}.db")},
            "simulation": {"scenario_dir": str(self.scenarios), "workdir": str(tmp / "sim"), "fake_nvml": self.fake},
            "logging": {"syslog": False},
            "notify": {"urls": [hook.url("/alerts")]},
            "metrics": {"textfile_dir": str(tmp / "prom" / "{node}")},
            "monitor": {"train_log": str(self.job_dir / "train.log"), "py_spy": "py-spy", **monitor},
        }
        self.cfg_path = tmp / "config.yaml"
        self.cfg_path.write_text(yaml.safe_dump(self.config))
        self.monitors: list[Monitor] = []

    def node(self, name: str, gpus: dict, nvml_lines: tuple[str, ...] = ()) -> None:
        """A node's scenario; `nvml_lines` are raw fake-NVML settings applied on top (later lines win)."""
        path = self.scenarios / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"instance_type": "p5.48xlarge", "gpus": gpus}))
        if nvml_lines:
            sim = materialize(str(path), str(self.tmp / "sim" / name), fake_nvml=self.fake)
            with open(sim.nvml_env["GPUGUARD_FAKE_NVML_FILE"], "a") as f:
                f.write("\n".join(nvml_lines) + "\n")

    def cfg(self):
        return parse_config(self.cfg_path.read_text(), source=str(self.cfg_path))

    def monitor(self, name: str, job_id: str = "5150", interval: float = 10.0) -> Monitor:
        m = Monitor(self.cfg(), str(self.job_dir), name, job_id, interval)
        self.monitors.append(m)
        return m

    def monitor_once(self, name: str, job_id: str = "5150") -> dict:
        """Another node's sidecar, as its own process (NVML is one session per process)."""
        p = subprocess.run([sys.executable, "-m", "gpuguard", "monitor", "--config", str(self.cfg_path), "--job-dir",
                            str(self.job_dir), "--node", name, "--job-id", job_id, "--once"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    def close(self) -> None:
        for m in self.monitors:
            m.close()


@pytest.fixture
def site(tmp_path, hook):
    sites = []

    def make(**monitor):
        s = Site(tmp_path, hook, **monitor)
        sites.append(s)
        return s

    yield make
    for s in sites:
        s.close()


def alerts_of(hook, check):
    return [r["body"] for r in hook.requests if f" {check}" in r["body"]["title"]]


# --------------------------------------------------------------------------- stragglers


def test_throttled_gpu_is_a_straggler_alert(site, hook):
    s = site(straggler_samples=2)
    s.node("node1", {"defaults": BUSY})
    # node2's GPU 3: hardware slowdown, SM clock held at 1200 of 1980 MHz
    s.node("node2", {"defaults": BUSY, "overrides": {3: {"throttle": ["hw_slowdown", "sw_power_cap"]}}},
           nvml_lines=("gpu.3.clock.sm=1200",))
    peer = s.monitor_once("node1")
    assert [g["sm_clock_mhz"] for g in peer["gpus"]] == [1980] * 8 and peer["alerts"] == []

    mon = s.monitor("node2")
    first = mon.step()
    assert first["alerts"] == []  # a straggler must persist straggler_samples (2) samples in a row
    second = mon.step()
    # one GPU, one cause: the low clock is the throttling's doing, told in the throttle alert (one page)
    assert {(a["check_id"], a["gpu"]) for a in second["alerts"]} == {("monitor.gpu_throttle", 3)}
    hook.wait_for(1)
    throttle = alerts_of(hook, "monitor.gpu_throttle")
    assert len(throttle) == 1 and "node2" in throttle[0]["title"]
    msg = throttle[0]["message"]
    assert "GPU 3 throttled (hw_slowdown)" in msg
    assert "GPU 3 SM clock 1200 MHz is 61% of the job's median 1980 MHz (16 busy GPUs on 2 node(s))" in msg
    # once per episode: more samples of the same condition do not page again
    mon.step()
    mon.step()
    assert len(hook.requests) == 1
    events = [json.loads(line) for line in (s.job_dir / "gpuguard" / "events.jsonl").read_text().splitlines()]
    assert {e["check"] for e in events} == {"monitor.gpu_throttle"}


def test_a_hot_throttling_gpu_pages_once():
    """Issue 16: one hot GPU sent two pages (temperature and throttle). One GPU, one cause, one alert."""
    from gpuguard.config.sections.monitor import MonitorConfig
    from gpuguard.monitor.detect import gpu_alerts, one_per_gpu_cause
    from gpuguard.monitor.sampler import GpuSample

    hot = GpuSample(index=6, temp_c=91, temp_slowdown_c=89, sm_clock_mhz=1100, sm_clock_max_mhz=1980,
                    throttle_mask=0x40 | 0x8)
    capped = GpuSample(index=2, temp_c=60, temp_slowdown_c=89, throttle_mask=0x80)  # power brake: another cause
    p = MonitorConfig(gpu_temp_max_c=None, gpu_power_max_w=None, gpu_memory_percent_max=None, ecc_uncorrected_max=0,
                      throttle=True)
    raw = gpu_alerts([hot, capped], {}, p)
    assert {(a.check_id, a.gpu) for a in raw} == {("monitor.gpu_temp", 6), ("monitor.gpu_throttle", 6),
                                                 ("monitor.gpu_throttle", 2)}
    merged = one_per_gpu_cause(raw)
    assert {(a.check_id, a.gpu) for a in merged} == {("monitor.gpu_temp", 6), ("monitor.gpu_throttle", 2)}
    temp = next(a for a in merged if a.gpu == 6)
    assert "throttling (hw_slowdown, hw_thermal)" in temp.message and temp.evidence["throttle"]


def test_healthy_busy_node_raises_nothing(site, hook):
    s = site(straggler_samples=1)
    s.node("node1", {"defaults": BUSY})
    s.node("node2", {"defaults": BUSY})
    s.monitor_once("node1")
    mon = s.monitor("node2")
    for _ in range(3):
        assert mon.step()["alerts"] == []
    assert hook.requests == []


def test_slow_node_step_time_against_peers(site, hook):
    """Per-node logs (torchrun --log-dir, one log per node): node2's iterations take 1.6x the others'."""
    s = site(straggler_samples=1, train_log=str(Path("{job_dir}") / "logs" / "{node}.log"))
    logs = s.job_dir / "logs"
    logs.mkdir(parents=True)
    for node, ms in (("node1", 800.0), ("node3", 820.0), ("node2", 1300.0)):
        (logs / f"{node}.log").write_text("".join(MEGATRON.format(s=i, it=i * 10, cs=i * 2560, ms=ms, loss=3.0)
                                                  for i in range(1, 6)))
        s.node(node, {"defaults": BUSY})
    s.monitor_once("node1")
    s.monitor_once("node3")
    report = s.monitor("node2").step()
    assert [a["check_id"] for a in report["alerts"]] == ["monitor.step_time"]
    assert report["step_time_s"] == pytest.approx(1.3)
    assert "step time 1.3 s vs the other nodes' median 0.81 s" in hook.wait_for(1)[0]["body"]["message"]


# --------------------------------------------------------------------------- hangs


def test_stalled_log_is_a_hang_with_stacks_and_one_report(site, hook, tmp_path):
    s = site(hang_minutes=1.0, requeue_on_hang=True,
             requeue_command=[sys.executable, str(tmp_path / "requeue_stub.py"), "--job", "{job_id}"])
    # the stub also keeps what the job directory said while it ran: the monitor's intent is recorded before it
    events = s.job_dir / "gpuguard" / "events.jsonl"
    (tmp_path / "requeue_stub.py").write_text(
        f"import shutil, sys\nopen({str(tmp_path / 'requeued')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"shutil.copy({str(events)!r}, {str(tmp_path / 'events-while-asking')!r})\n")
    s.node("node1", {"defaults": BUSY})
    log = s.job_dir / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(MEGATRON.format(s=i, it=i * 10, cs=i * 2560, ms=850.0, loss=3.0) for i in range(1, 4)))
    # a rank of the job, stuck (as in a collective waiting for a dead peer); py-spy must find it
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        def wait_for_allreduce():
            time.sleep(120)
        wait_for_allreduce()
        """)], env={**os.environ, "SLURM_JOB_ID": "5150"})
    try:
        mon = s.monitor("node1")
        t0 = time.time()
        assert mon.step(now=t0)["last_iteration"] == 30
        assert mon.step(now=t0 + 30)["alerts"] == []  # 30 s without progress is not a hang
        other = s.monitor("node3")  # another node's sidecar sees the same stalled log (its scenario is missing:
        # it samples no GPU, says so, and goes on)
        assert other.gpus.init_error and "no scenario for node node3" in other.gpus.init_error
        report = mon.step(now=t0 + 90)
        assert [a["check_id"] for a in report["alerts"]] == ["monitor.progress"]
        other.step(now=t0)  # its first look at the log
        assert other.step(now=t0 + 91)["fired"] == []  # node1 claimed this hang: node3 stays quiet
    finally:
        rank.kill()
        rank.wait()
    hook.wait_for(2)
    hang = [b for b in alerts_of(hook, "monitor.progress") if "job hang" in b["title"]]
    assert len(hang) == 1 and "node1" in hang[0]["title"]
    msg = hang[0]["message"]
    assert "training stalled: no new iteration since 30 for 1.5 min" in msg and "job:      5150" in msg
    stacks = list((s.job_dir / "gpuguard" / "stacks").glob("node1-*.txt"))
    assert len(stacks) == 1 and "stack(s) dumped to" in msg
    if "py-spy not available" not in msg:
        assert "wait_for_allreduce" in stacks[0].read_text()
    # the requeue went through the configured command, once, with the job id as one argument
    assert (tmp_path / "requeued").read_text() == "--job 5150\n"
    requeue = [r["body"] for r in hook.wait_for(2) if "job requeue requested" in r["body"]["title"]]
    assert requeue and "requeue requested" in requeue[0]["message"]
    # intent, then outcome (gpuguard job-attempt end must never miss the monitor's requeue, however fast the job
    # stops): the ask was in the job directory while the command ran, its outcome after
    asked = [json.loads(e) for e in (tmp_path / "events-while-asking").read_text().splitlines()]
    assert [(e["kind"], e.get("phase")) for e in asked][-1] == ("requeue", "asking")
    final = [json.loads(e) for e in events.read_text().splitlines() if '"requeue"' in e]
    assert [(e["phase"], e.get("ok")) for e in final] == [("asking", None), ("done", True)]
    assert final[0]["ts"] == final[1]["ts"] and final[1]["check"] == "monitor.progress"


def test_progress_resumes_then_stalls_again_alerts_again(site, hook):
    s = site(hang_minutes=1.0)
    s.node("node1", {"defaults": BUSY})
    log = s.job_dir / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text(MEGATRON.format(s=1, it=10, cs=2560, ms=850.0, loss=3.0))
    mon = s.monitor("node1")
    t0 = time.time()
    mon.step(now=t0)
    assert mon.step(now=t0 + 70)["fired"] == ["monitor.progress:sent"]
    with log.open("a") as f:
        f.write(MEGATRON.format(s=2, it=20, cs=5120, ms=850.0, loss=2.9))
    resumed = mon.step(now=t0 + 80)
    assert resumed["alerts"] == [] and resumed["resolved"] == ["monitor.progress:sent"]  # the episode ended
    # a new episode: paged again, with the same dedupe key (one incident per job hang, opened and resolved)
    assert mon.step(now=t0 + 150)["fired"] == ["monitor.progress:sent"]
    events = [json.loads(e) for e in (s.job_dir / "gpuguard" / "events.jsonl").read_text().splitlines()]
    assert [(e["check"], e.get("state", "firing")) for e in events] == [
        ("monitor.progress", "firing"), ("monitor.progress", "resolved"), ("monitor.progress", "firing")]
    bodies = [r["body"] for r in hook.wait_for(3)]
    assert [b["status"] for b in bodies] == ["firing", "resolved", "firing"]
    assert {b["dedup_key"] for b in bodies} == {"gpuguard/job5150/hang"}
    assert bodies[1]["type"] == "success" and "RESOLVED job hang node1" in bodies[1]["title"]


def test_all_gpus_idle_is_a_hang(site, hook):
    s = site(idle_minutes=2.0, train_log=None)
    s.node("node1", {"defaults": {"utilization_pct": 0}})
    mon = s.monitor("node1")
    t0 = time.time()
    assert mon.step(now=t0)["idle_since"] == t0
    assert mon.step(now=t0 + 60)["alerts"] == []
    report = mon.step(now=t0 + 130)
    assert [a["check_id"] for a in report["alerts"]] == ["monitor.gpu_idle"]
    assert "every GPU idle for 2.2 min on this node" in hook.wait_for(1)[0]["body"]["message"]


# --------------------------------------------------------------------------- thresholds and metrics


def test_disk_threshold_alerts_only_once_sustained(site, hook):
    s = site(disk_percent_max=0.0, sustain_s=300.0, cpu_percent_max=None, memory_percent_max=None,
             train_log=None)
    s.node("node1", {"defaults": BUSY})
    mon = s.monitor("node1")
    t0 = time.time()
    assert mon.step(now=t0)["alerts"] == []
    report = mon.step(now=t0 + 301)
    assert {a["check_id"] for a in report["alerts"]} >= {"monitor.disk:/"}
    assert any("monitor.disk:/ " in r["body"]["title"] + " " for r in hook.wait_for(1))


def test_new_uncorrectable_ecc_error_during_the_job(site, hook, tmp_path):
    s = site(train_log=None)
    s.node("node1", {"defaults": BUSY})
    mon = s.monitor("node1")
    assert mon.step()["alerts"] == []
    mon.close()  # the driver's counter goes up: a new session sees it
    with open(tmp_path / "sim" / "node1" / "nvml.txt", "a") as f:
        f.write("gpu.5.ecc.volatile.uncorrected=2\n")
    mon2 = s.monitor("node1")
    mon2.ecc_baseline = dict(mon.ecc_baseline)  # same job: same baseline
    report = mon2.step()
    assert [(a["check_id"], a["gpu"], a["severity"]) for a in report["alerts"]] == [("monitor.ecc", 5, "critical")]


def test_monitor_metrics_file_parses(site, tmp_path):
    s = site(train_log=None)
    s.node("node1", {"defaults": BUSY, "overrides": {2: {"temperature_c": 71}}})
    s.monitor("node1").step()
    text = (tmp_path / "prom" / "node1" / "gpuguard_monitor.prom").read_text()
    samples = {(x.name, x.labels.get("gpu")): x.value for f in text_string_to_metric_families(text)
               for x in f.samples}
    # base units (docs/metrics.md); the node's CPU/memory/disk/network are node_exporter's, not repeated here
    assert samples[("gpuguard_gpu_temperature_celsius", "2")] == 71
    assert samples[("gpuguard_gpu_sm_clock_hertz", "0")] == 1980e6
    assert samples[("gpuguard_gpu_utilization_ratio", "7")] == pytest.approx(0.97)
    # the monitor here runs inside this pytest worker: its figure is this process's RSS (whatever earlier tests of
    # the worker left in it); the sidecar's own budget as a process is test_cost_per_sample_fits_the_budget's
    import psutil
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < samples[("gpuguard_monitor_resident_memory_bytes", None)] <= 1.5 * rss
    assert not [name for name, _ in samples if name.startswith("gpuguard_node_")]


def test_cost_per_sample_fits_the_budget(site, tmp_path):
    """The sidecar as a process: < 1 % of one core at the default 10 s interval, < 60 MB RSS (measured over
    fast samples and scaled: CPU per sample / 10 s)."""
    import psutil

    s = site(train_log=None, interval_s=0.25)
    s.node("node1", {"defaults": BUSY})
    log = s.job_dir / "train.log"
    log.parent.mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-m", "gpuguard", "monitor", "--config", str(s.cfg_path), "--job-dir",
                          str(s.job_dir), "--node", "node1", "--job-id", "1", "--duration", "6"],
                         stderr=subprocess.PIPE, text=True)
    proc = psutil.Process(p.pid)
    time.sleep(2.0)  # past start-up (imports, NVML init)
    c0, t0 = proc.cpu_times(), time.monotonic()
    time.sleep(3.0)
    c1, t1 = proc.cpu_times(), time.monotonic()
    rss = proc.memory_info().rss
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    samples = (t1 - t0) / 0.25
    cpu_per_sample = (c1.user + c1.system - c0.user - c0.system) / samples
    print(f"monitor: {cpu_per_sample * 1000:.1f} ms CPU per sample -> {cpu_per_sample / 10 * 100:.2f}% of one "
          f"core at 10 s; RSS {rss / 2**20:.1f} MiB")
    assert cpu_per_sample / 10.0 < 0.01
    assert rss < 60 * 2**20
    assert "stopping after" in err


def test_the_hang_page_names_the_stuck_node_not_the_one_that_claimed_it(site, hook):
    """Issue 29 item 4: one shared training log stalls, so every node's monitor sees the hang and node1 claims it
    first; node3's GPUs went idle while node1's and node2's spin in the collective waiting for it: the page is
    about node3 (title and message), says node1 reported it, and points at no stack dump (py_spy null). node1
    also asks for the requeue: that page is about node3 too, and so is the record `gpuguard job-attempt end`
    reads (the ledger's "hang" names the stuck node, not the one that asked)."""
    s = site(hang_minutes=1.0, py_spy=None, requeue_on_hang=True, requeue_command=[sys.executable, "-c", "pass"])
    s.node("node1", {"defaults": BUSY})
    s.node("node2", {"defaults": BUSY})
    s.node("node3", {"defaults": {"utilization_pct": 0}})
    log = s.job_dir / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(MEGATRON.format(s=i, it=i * 10, cs=i * 2560, ms=850.0, loss=3.0) for i in range(1, 4)))
    mon = s.monitor("node1")
    t0 = time.time()
    mon.step(now=t0 - 90)  # the log's last iteration, 90 s ago
    for other in ("node2", "node3"):  # the other nodes' sidecars (own processes: one NVML session each)
        assert s.monitor_once(other)["node"] == other
    report = mon.step(now=time.time())
    assert report["fired"] == ["monitor.progress:sent"]  # node1 holds the claim
    page = [b for b in alerts_of(hook, "monitor.progress") if "job hang" in b["title"]]
    hook.wait_for(1)
    page = [r["body"] for r in hook.requests if "job hang" in r["body"]["title"]]
    assert [p["title"] for p in page] == ["gpuguard: job hang node3 monitor.progress"], page
    msg = page[0]["message"]
    assert "stuck: node3: every GPU idle" in msg and "while node[1-2] are busy" in msg, msg
    assert "reported by node1" in msg
    assert "stack dump" not in msg.replace("no stack dump was taken (monitor.py_spy is null)", ""), msg
    assert "py-spy not available" not in msg and "pip install" not in msg
    events = [json.loads(e) for e in (s.job_dir / "gpuguard" / "events.jsonl").read_text().splitlines()]
    assert [e.get("stuck") for e in events if e.get("reported")] == [["node3"]]
    requeue = [r["body"] for r in hook.wait_for(2) if "requeue" in r["body"]["title"]]
    assert [p["title"] for p in requeue] == ["gpuguard: job requeue requested node3 monitor.progress"], requeue
    assert "reported_by" in requeue[0]["message"] and "node1" in requeue[0]["message"]
    assert requeue_asked(events, t0 - 1) == "monitor.progress, stuck: node3 (asked by node1)"


def test_a_requeued_attempt_resuming_is_start_up_not_a_hang(site, hook, monkeypatch):
    """The job's output file (the training log) still holds the previous attempt's iterations when a requeued
    attempt's monitor starts: they are not this attempt's progress, so loading the checkpoint is judged against
    startup_minutes, not hang_minutes (it was paged and requeued again as a hang after hang_minutes)."""
    s = site(hang_minutes=1.0, startup_minutes=5.0, cpu_percent_max=None, memory_percent_max=None,
             disk_percent_max=None)  # only the progress check: a loaded CI machine trips the host ones
    s.node("node1", {"defaults": BUSY})
    log = s.job_dir / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(MEGATRON.format(s=i, it=i * 10, cs=i * 2560, ms=850.0, loss=3.0) for i in range(1, 4)))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    mon = s.monitor("node1")
    t0 = time.time()
    assert mon.step(now=t0)["last_iteration"] == 30  # known, but the previous attempt's
    assert mon.step(now=t0 + 120)["alerts"] == []  # 2 min resuming: start-up, not a hang
    with log.open("a") as f:
        f.write(MEGATRON.format(s=4, it=40, cs=10240, ms=850.0, loss=2.8))
    assert mon.step(now=t0 + 130)["alerts"] == []
    stalled = mon.step(now=t0 + 200)  # then this attempt's own progress stops for over hang_minutes
    assert [a["check_id"] for a in stalled["alerts"]] == ["monitor.progress"]
    assert "no new iteration since 40" in stalled["alerts"][0]["message"]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # the next attempt never logs an iteration: start-up runs out
    mon2 = s.monitor("node1")
    t1 = time.time()
    assert mon2.step(now=t1)["alerts"] == []
    assert mon2.step(now=t1 + 290)["alerts"] == []
    late = mon2.step(now=t1 + 301)["alerts"]
    assert [a["check_id"] for a in late] == ["monitor.progress"]
    assert "no training iteration logged yet" in late[0]["message"]
