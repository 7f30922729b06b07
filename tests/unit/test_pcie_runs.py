"""PCIe judged on the trained link (issue 9), in whole runs on simulated p5.48xlarge nodes: a link at x8 under load
drains for a reboot, the same reading at idle never does, and the replay rate is measured between runs."""

from __future__ import annotations

import time

from gpuguard.model import Severity
from gpuguard.runner import execute
from gpuguard.store import Store

from simnode import MemorySlurm, ctx, make_cfg, write_scenario


def _run(tmp_path, body, kind):
    scen = write_scenario(tmp_path, "s", body)
    slurm = MemorySlurm()
    return execute(ctx(kind), make_cfg(tmp_path), simulate=scen, slurm_client=slurm), slurm, scen


def test_x8_link_under_load_drains_in_the_health_check(tmp_path):
    body = {"gpus": {"defaults": {"throttle": [], "utilization_pct": 100},
                     "overrides": {3: {"pcie_width": 8}}}}
    result, slurm, _ = _run(tmp_path, body, "healthcheck")
    assert result.verdict.outcome == "drain" and result.verdict.action.value == "reboot"
    assert "x8 (expected x16) under load" in slurm.calls[0][1]


def test_x8_link_at_idle_is_not_a_drain(tmp_path):
    body = {"gpus": {"overrides": {3: {"pcie_width": 8, "pcie_gen": 1}}}}  # idle: gpu_idle clock reason set
    result, slurm, _ = _run(tmp_path, body, "prolog")
    assert result.verdict.outcome == "pass" and not slurm.calls
    f = next(f for f in result.findings if f.check_id == "gpu.pcie")
    assert "idle readings not judged: GPU 3 x8" in f.message


def test_replay_rate_between_runs(tmp_path):
    body = {"gpus": {"overrides": {1: {"pcie_replay": 400}}}}
    scen = write_scenario(tmp_path, "s", body)
    first = execute(ctx("healthcheck"), make_cfg(tmp_path), simulate=scen, slurm_client=MemorySlurm())
    g1 = next(g for g in first.observations.nvml.gpus if g.index == 1)
    uuid = g1.uuid
    with Store(str(tmp_path / "state" / "n1.db")) as st:
        baseline = st.get_cursor("pcie_replay:n1")
        assert baseline[uuid][0] == 400
        baseline[uuid] = [0, time.time() - 600]  # as if the last reading was 0 replays, 10 minutes ago
        st.set_cursor("pcie_replay:n1", baseline)
    second = execute(ctx("healthcheck"), make_cfg(tmp_path), simulate=scen, slurm_client=MemorySlurm())
    f = next(f for f in second.findings if f.check_id == "gpu.pcie")
    assert f.severity is Severity.WARN and f.gpu == 1 and "40 PCIe replays/min" in f.message
    assert second.verdict.outcome == "warn"
