"""On a real local Slurm cluster: `gpuguard status` / `history` after a real prolog drain, and `gpuguard monitor`
as the torchrun template starts it (`srun --overlap`, one task per node) inside a real 2-node job, alerting a
local webhook about a throttled GPU on one node."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from gpuguard.simulate.scenario import materialize

JOB = "#!/bin/sh\nsrun -l hostname\n"  # one step: every node of the job prints its name


@pytest.mark.slow(12)
def test_status_and_history_after_a_real_drain(site_factory):
    site = site_factory(nodes=3)
    site.set_scenario("node2", "xid79")
    job = site.cluster.sbatch(JOB, "-N2", "--gres=gpu:8")
    assert site.cluster.wait_job(job, timeout=60)["JobState"] == "COMPLETED"
    site.cluster.drain("node1", "admin: replacing PSU [ticket 4411]")
    # the same fault on node3, found by its health check: one group, the nodes as a hostlist
    site.set_scenario("node3", "xid79")
    hc = site.run_hook("healthcheck", "node3")
    assert "DRAIN" in site.cluster.node_flags("node3"), (hc.stdout, hc.stderr)

    p = site.gpuguard("status")
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert "XID79 gpu.xid  node[2-3]  reboot" in out, p.stdout
    rows = {line.split()[0]: line for line in out if line.startswith("  node")}
    assert set(rows) == {"node2", "node3"}, p.stdout
    assert " never " in rows["node2"]  # drained by the prolog; no health check has run on node2 since
    assert re.search(r" 20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ drain ", rows["node3"]), rows["node3"]
    status = json.loads(site.gpuguard("status", "--json").stdout)["nodes"]
    assert [n["node"] for n in status] == ["node2", "node3"]
    assert status[0]["keyword"] == "XID79" and status[0]["last_run"]["verdict"] == "drain"
    assert re.fullmatch(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ", status[0]["drained_at"])
    assert 0 <= status[0]["drained_for_s"] < 300
    assert status[1]["last_healthcheck"]["verdict"] == "drain"
    everyone = site.gpuguard("status", "--all").stdout
    assert "node1" in everyone and "not gpuguard's" in everyone

    h = json.loads(site.gpuguard("history", "--json").stdout)
    assert {r["node"] for r in h["runs"]} >= {"node1", "node2", "node3"}  # every node's store, one view
    drain = next(d for d in h["drains"] if d["node"] == "node2")
    assert drain["outcome"] == "done" and "XID79" in drain["reason"]
    csv_text = site.gpuguard("history", "--node", "node2", "--csv").stdout
    assert csv_text.startswith("type,time,node") and ",drain,done,gpu.xid," in csv_text


def test_monitor_sidecar_in_a_real_job_reports_the_throttled_gpu(site_factory, hook, tmp_path):
    site = site_factory(nodes=2)
    throttled = tmp_path / "throttled.yaml"
    throttled.write_text(yaml.safe_dump({"instance_type": "p5.48xlarge", "gpus": {
        "defaults": {"utilization_pct": 97, "throttle": ["sw_power_cap"], "power_w": 650},
        "overrides": {3: {"throttle": ["hw_slowdown", "sw_power_cap"]}}}}))
    busy = tmp_path / "busy.yaml"
    busy.write_text(yaml.safe_dump({"instance_type": "p5.48xlarge", "gpus": {
        "defaults": {"utilization_pct": 97, "throttle": ["sw_power_cap"], "power_w": 650}}}))
    site.set_scenario("node1", str(busy))
    site.set_scenario("node2", str(throttled))
    # The prolog would (rightly) refuse node2 for HW slowdown; in life the throttling starts during the job. The
    # kill switch keeps the prolog out of this test about the sidecar.
    site.write_config({"notify": {"urls": [hook.url("/alerts")]}, "checks": {"gpu.throttle": False},
                       "monitor": {"straggler_samples": 2, "train_log": None}})
    # node2's GPU 3 runs at 1200 MHz: a raw fake-NVML setting on top of its scenario
    sim = materialize(str(site.scenarios / "node2.yaml"), str(site.workdir / "sim" / "node2"),
                      fake_nvml=site.config["simulation"]["fake_nvml"])
    with open(sim.nvml_env["GPUGUARD_FAKE_NVML_FILE"], "a") as f:
        f.write("gpu.3.clock.sm=1200\n")

    job_dir = tmp_path / "jobdir"
    script = (f"#!/bin/sh\nexport GPUGUARD_CONFIG={site.config_path}\n"
              f"srun --overlap --ntasks-per-node=1 {site.python} -m gpuguard monitor --job-dir {job_dir} "
              f"--interval 0.5 --duration 5\n")
    job = site.cluster.sbatch(script, "-N2", "--gres=gpu:8")
    info = site.cluster.wait_job(job, timeout=60)
    assert info["JobState"] == "COMPLETED", site.cluster.job_output(job)

    reports = {p.stem: json.loads(p.read_text()) for p in (job_dir / "gpuguard" / "monitor").glob("*.json")}
    assert set(reports) == {"node1", "node2"}  # one sidecar per node, each on its own (simulated) GPUs
    assert reports["node1"]["job_id"] == job and reports["node2"]["gpus"][3]["sm_clock_mhz"] == 1200
    titles = [r["body"]["title"] for r in hook.wait_for(1)]
    # one GPU, one cause, one page: its low clock is told in the throttle alert
    assert sorted(t for t in titles if "node2" in t) == ["gpuguard: straggler node2 monitor.gpu_throttle"]
    assert not [t for t in titles if "node1" in t]
    out = site.cluster.job_output(job)
    assert "monitoring node node1" in out and "WARNING monitor.gpu_throttle: GPU 3 throttled" in out
    assert "GPU 3 SM clock 1200 MHz" in out
