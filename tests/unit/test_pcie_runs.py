"""PCIe judged on the trained link (issue 9), in whole runs on simulated p5.48xlarge nodes: a link at x8 under load
drains for a reboot once the node's own history shows it trained x16 under load (issue 14: a link that never
trained wider on this node warns), the same reading at idle never does, and the replay rate is measured between
runs."""

from __future__ import annotations

import time

from gpuguard.model import Severity
from simnode import run_sim
from gpuguard.store.sqlite import Store

from simnode import MemorySlurm, ctx, make_cfg, write_scenario


def _run(tmp_path, body, kind):
    scen = write_scenario(tmp_path, "s", body)
    slurm = MemorySlurm()
    return run_sim(ctx(kind), make_cfg(tmp_path), simulate=scen, slurm_client=slurm), slurm, scen


def test_x8_link_under_load_drains_in_the_health_check(tmp_path):
    busy = {"throttle": [], "utilization_pct": 100}
    healthy, slurm, _ = _run(tmp_path, {"gpus": {"defaults": busy}}, "healthcheck")  # seen at x16 under load
    assert healthy.verdict.outcome == "pass" and not slurm.calls
    body = {"gpus": {"defaults": busy, "overrides": {3: {"pcie_width": 8}}}}
    result, slurm, _ = _run(tmp_path, body, "healthcheck")
    assert result.verdict.outcome == "drain" and result.verdict.action.value == "reboot"
    assert "x8 (expected x16) under load" in slurm.calls[0][1]


def test_x8_link_under_load_on_a_node_never_seen_wider_warns(tmp_path):
    body = {"gpus": {"defaults": {"throttle": [], "utilization_pct": 100}, "overrides": {3: {"pcie_width": 8}}}}
    result, slurm, _ = _run(tmp_path, body, "healthcheck")
    assert result.verdict.outcome == "warn" and not slurm.calls
    f = next(f for f in result.findings if f.check_id == "gpu.pcie")
    assert f.gpu == 3 and f.evidence["launch_choice"] and "never trained higher under load" in f.message


def test_x8_link_at_idle_is_not_a_drain(tmp_path):
    body = {"gpus": {"overrides": {3: {"pcie_width": 8, "pcie_gen": 1}}}}  # idle: gpu_idle clock reason set
    result, slurm, _ = _run(tmp_path, body, "prolog")
    assert result.verdict.outcome == "pass" and not slurm.calls
    f = next(f for f in result.findings if f.check_id == "gpu.pcie")
    assert "idle readings not judged: GPU 3 x8" in f.message


def test_replay_rate_between_runs(tmp_path):
    body = {"gpus": {"overrides": {1: {"pcie_replay": 400}}}}
    scen = write_scenario(tmp_path, "s", body)
    first = run_sim(ctx("healthcheck"), make_cfg(tmp_path), simulate=scen, slurm_client=MemorySlurm())
    g1 = next(g for g in first.observations.nvml.gpus if g.index == 1)
    uuid = g1.uuid
    with Store(str(tmp_path / "state" / "n1.db")) as st:
        baseline = st.get_cursor("pcie_replay:n1")
        assert baseline[uuid][0] == 400
        baseline[uuid] = [0, time.time() - 600]  # as if the last reading was 0 replays, 10 minutes ago
        st.set_cursor("pcie_replay:n1", baseline)
    second = run_sim(ctx("healthcheck"), make_cfg(tmp_path), simulate=scen, slurm_client=MemorySlurm())
    f = next(f for f in second.findings if f.check_id == "gpu.pcie")
    assert f.severity is Severity.WARN and f.gpu == 1 and "40 PCIe replays/min" in f.message
    assert second.verdict.outcome == "warn"


def test_real_h100_idle_and_loaded_readings():
    """Readings gpuguard took on a real H100 SXM (tests/fixtures/nvml/h100_gpuguard_observations.json): idle shows
    the GPU-idle clock reason and 0 %, a bf16 matmul 0x0 and 99 %; both Gen5 x16 there."""
    import json
    from pathlib import Path

    from gpuguard.checks import CheckInput, get_check
    from gpuguard.checks.gpu import gpu_busy
    from gpuguard.model import GpuInfo, NvmlObservation, Observations
    from gpuguard.profiles import load_profile

    data = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "nvml"
                       / "h100_gpuguard_observations.json").read_text())
    fields = set(GpuInfo.__dataclass_fields__)
    idle = GpuInfo(**{k: v for k, v in data["idle"].items() if k in fields and k != "processes"})
    load = GpuInfo(**{k: v for k, v in data["load"].items() if k in fields and k != "processes"})
    assert not gpu_busy(idle) and gpu_busy(load)
    spec = get_check("gpu.pcie")
    for g, busy in ((idle, []), (load, [0])):
        obs = Observations(nvml=NvmlObservation(device_count=1, gpus=[g]))
        (f,) = spec(obs, CheckInput(profile=load_profile("p5.48xlarge"), params={}))
        assert f.severity is Severity.OK and f.evidence["busy"] == busy
        # the same GPU at x8, on a node that saw it train x16 under load: drained only on the loaded reading
        g8 = GpuInfo(**{**g.__dict__, "pcie_width_current": 8})
        seen_x16 = {"inventory": {"pcie": {g.uuid: [5, 16]}}}
        (f8,) = spec(Observations(nvml=NvmlObservation(device_count=1, gpus=[g8]), previous=seen_x16),
                     CheckInput(profile=load_profile("p5.48xlarge"), params={}))
        assert f8.severity is (Severity.FAIL if busy else Severity.OK)
