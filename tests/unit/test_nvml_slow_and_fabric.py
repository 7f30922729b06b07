"""Whole runs on simulated nodes (issue 9): an NVML that is slow to start (persistence mode off) is not a hang; an
NVSwitch node whose Fabric Manager did not register a GPU is drained; throttling drains only once it persists."""

from __future__ import annotations

import time

from gpuguard.model import Severity
from simnode import run_sim
from gpuguard.store.sqlite import Store

from simnode import MemorySlurm, ctx, make_cfg, write_scenario


def _run(tmp_path, body, kind="prolog", slurm=None, **cfg_sections):
    scen = write_scenario(tmp_path, "s", body)
    slurm = slurm or MemorySlurm()
    cfg = make_cfg(tmp_path, **cfg_sections)
    t0 = time.monotonic()
    result = run_sim(ctx(kind), cfg, simulate=scen, slurm_client=slurm)
    return result, slurm, time.monotonic() - t0


def _finding(result, check_id, severity=None):
    return next(f for f in result.findings if f.check_id == check_id and (severity is None or f.severity is severity))


def test_slow_nvml_start_without_persistence_is_a_warning_not_a_hang(tmp_path):
    body = {"nvml": {"hang": {"nvmlInitWithFlags": 2}},
            "gpus": {"defaults": {"persistence_mode": False}}}
    result, slurm, took = _run(tmp_path, body, deadlines={"nvml_s": 1.5})
    assert result.verdict.outcome == "warn" and not slurm.calls, result.verdict.reason
    f = _finding(result, "gpu.nvml", Severity.WARN)
    assert "NVML answered only after 2." in f.message and "persistence mode is off on GPU 0,1,2" in f.message
    assert "nvidia-persistenced" in f.remediation
    assert took < 5


def test_nvml_that_never_answers_is_still_a_hang(tmp_path):
    body = {"nvml": {"hang": {"nvmlInitWithFlags": 3600}}}
    result, slurm, took = _run(tmp_path, body, deadlines={"nvml_s": 1.0})
    assert result.verdict.outcome == "drain" and "TIMEOUT" in slurm.calls[0][1]
    assert 2.0 <= took < 6  # waited once more (1 s + 1 s) before calling it a hang


def test_persistence_mode_is_reported(tmp_path):
    result, _, _ = _run(tmp_path, {"gpus": {"overrides": {5: {"persistence_mode": False}}}})
    f = _finding(result, "gpu.nvml")
    assert f.severity is Severity.OK and "persistence mode off on GPU 5" in f.message


def test_fabric_manager_not_started_drains_an_nvswitch_node(tmp_path):
    result, slurm, _ = _run(tmp_path, {"gpus": {"defaults": {"fabric_state": "not_started"}}})
    assert result.verdict.outcome == "drain" and "FABRIC" in slurm.calls[0][1]
    assert "nvidia-fabricmanager" in result.verdict.primary.remediation


def test_fabric_registration_failure_needs_a_reboot(tmp_path):
    result, slurm, _ = _run(tmp_path, {"gpus": {"overrides": {2: {"fabric_status": "UNKNOWN"}}}})
    assert result.verdict.action.value == "reboot" and "registration failed" in result.verdict.reason


def test_fabric_degraded_bandwidth_and_healthy(tmp_path):
    result, _, _ = _run(tmp_path, {"gpus": {"overrides": {1: {"fabric_health_mask": 0x1}}}})
    assert "NVLink bandwidth degraded" in result.verdict.reason
    (tmp_path / "h").mkdir()
    healthy, _, _ = _run(tmp_path / "h", {})
    assert _finding(healthy, "gpu.fabric").severity is Severity.OK


def test_fabric_skipped_on_a_gpu_without_fabric_info(tmp_path):
    # a single H100 without NVSwitch reports state NOT_SUPPORTED (read on a real one: tests/fixtures/nvml/)
    result, _, _ = _run(tmp_path, {"gpus": {"defaults": {"fabric_state": "not_supported"}}})
    assert _finding(result, "gpu.fabric").severity is Severity.SKIP


def test_hw_slowdown_drains_only_once_it_persists(tmp_path):
    """One sample of HW slowdown warns; the same GPU still throttled in the next run, persist_s later, drains."""
    body = {"gpus": {"overrides": {4: {"throttle": ["hw_slowdown"]}}}}
    cfg_sections = {"checks": {"gpu.throttle": {"persist_s": 1.0}}}
    slurm = MemorySlurm()
    first, _, _ = _run(tmp_path, body, kind="healthcheck", slurm=slurm, **cfg_sections)
    f = _finding(first, "gpu.throttle")
    assert f.severity is Severity.WARN and "drains if it persists 1s" in f.message and not slurm.calls
    time.sleep(1.1)
    second, _, _ = _run(tmp_path, body, kind="healthcheck", slurm=slurm, **cfg_sections)
    assert second.verdict.outcome == "drain" and "CLOCKS" in slurm.calls[0][1]
    assert "clocks throttled: hw_slowdown for " in second.verdict.primary.message


def test_hw_slowdown_that_clears_starts_over(tmp_path):
    throttled = {"gpus": {"overrides": {4: {"throttle": ["hw_slowdown"]}}}}
    cfg_sections = {"checks": {"gpu.throttle": {"persist_s": 0.5}}}
    slurm = MemorySlurm()
    _run(tmp_path, throttled, kind="healthcheck", slurm=slurm, **cfg_sections)
    time.sleep(0.6)
    clear, _, _ = _run(tmp_path, {}, kind="healthcheck", slurm=slurm, **cfg_sections)
    assert _finding(clear, "gpu.throttle").severity is Severity.OK
    again, _, _ = _run(tmp_path, throttled, kind="healthcheck", slurm=slurm, **cfg_sections)
    assert again.verdict.outcome == "warn" and not slurm.calls  # a new streak: seen for 0 s


def test_throttle_persistence_reads_the_store(tmp_path):
    body = {"gpus": {"overrides": {4: {"throttle": ["hw_slowdown"]}}}}
    _run(tmp_path, body, kind="healthcheck", checks={"gpu.throttle": {"persist_s": 600}})
    with Store(str(tmp_path / "state" / "n1.db")) as st:
        key = next(f for f in st.findings_for(st.runs(node="n1")[0]["id"]) if f["check_id"] == "gpu.throttle")
        assert '"persist"' in key["evidence"]
        assert st.persist_streak_start("n1", "gpu.throttle", "GPU-" + key["evidence"].split('"key": "GPU-')[1]
                                       .split('"')[0], 3600) is not None
