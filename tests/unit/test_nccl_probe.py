"""The optional tier's single-node NCCL probe run for real (the simulated all_reduce_perf as a subprocess, the
torch.distributed fallback with gloo on CPU), the nccl.busbw check, and the tier decision."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard.checks import CheckInput, get_check
from gpuguard.model import Action, Observations, Severity
from gpuguard.config.sections.nccl import NcclConfig
from gpuguard.nccl.probe import nccl_tests_argv, run_single_node_nccl, run_torch_probe
from gpuguard.nccl.tier import job_is_exclusive, tier_cursor, tier_due
from gpuguard.profiles import apply_overrides, load_profile
from devtools.nccl_tests_stub import install_stub

check_nccl_busbw = get_check("nccl.busbw")  # the check, with its spec bound

HAS_TORCH = __import__("importlib").util.find_spec("torch") is not None


def stub(tmp_path: Path, nccl: str = "") -> tuple[str, dict[str, str]]:
    scen = tmp_path / "scenarios"
    scen.mkdir(exist_ok=True)
    (scen / "node7.yaml").write_text("instance_type: p5.48xlarge\n" + (f"nccl: {nccl}\n" if nccl else ""))
    exe = install_stub(str(tmp_path / "bin"), str(scen))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["SLURMD_NODENAME"] = "node7"
    return str(exe), env


def inp(threshold: float | None = 350.0, **params) -> CheckInput:
    prof = apply_overrides(load_profile("p5.48xlarge"), {"nccl_busbw_gbps": threshold})
    return CheckInput(profile=prof, params=params, kind="prolog")


def test_healthy_node_passes_against_the_profile_floor(tmp_path):
    exe, env = stub(tmp_path)
    obs = run_single_node_nccl(exe, gpus=8, timeout_s=30, min_bytes=64 << 20, max_bytes=2 << 30, env=env)
    assert obs.ran and obs.exit_code == 0 and obs.status.complete
    assert obs.argv[1:] == ["-b", str(64 << 20), "-e", str(2 << 30), "-f", "2", "-g", "8", "-n", "20", "-w", "5", "-c", "1"]
    assert obs.result.hosts == ["node7"] and obs.result.ranks == 8
    f = check_nccl_busbw(Observations(nccl=obs), inp())
    assert [x.severity for x in f] == [Severity.OK] and "at 2 GiB" in f[0].message


def test_slow_node_fails_with_the_figure(tmp_path):
    exe, env = stub(tmp_path, "{slow_factor: 0.5}")
    obs = run_single_node_nccl(exe, gpus=8, timeout_s=30, min_bytes=256 << 20, max_bytes=4 << 30, env=env)
    (f,) = check_nccl_busbw(Observations(nccl=obs), inp())
    assert f.severity is Severity.FAIL and f.keyword == "NCCL" and f.action is Action.DRAIN
    assert re.match(r"all_reduce busbw (19\d|20[01])\.\d GB/s < 350 GB/s at 4 GiB$", f.message), f.message  # 400 x 0.5
    # the check's own parameter wins over the profile
    assert check_nccl_busbw(Observations(nccl=obs), inp(min_busbw_gbps=150))[0].severity is Severity.OK


def test_wrong_results_fail_even_at_full_speed(tmp_path):
    exe, env = stub(tmp_path, "{wrong: 12}")
    obs = run_single_node_nccl(exe, gpus=8, timeout_s=30, min_bytes=1 << 30, max_bytes=1 << 30, env=env)
    (f,) = check_nccl_busbw(Observations(nccl=obs), inp())
    assert f.severity is Severity.FAIL and "wrong data: 24 wrong" in f.message and f.action is Action.REBOOT


def test_nccl_error_is_incomplete_with_the_tools_line(tmp_path):
    exe, env = stub(tmp_path, "{fail: 'NCCL WARN NET/OFI Unable to find a usable provider'}")
    obs = run_single_node_nccl(exe, gpus=8, timeout_s=30, env=env)
    assert obs.exit_code == 2 and not obs.status.complete and "Test NCCL failure" in obs.error
    (f,) = check_nccl_busbw(Observations(nccl=obs), inp())
    assert f.severity is Severity.INCOMPLETE and "produced no result" in f.message


def test_hang_times_out(tmp_path):
    exe, env = stub(tmp_path, "{hang_s: 20}")
    obs = run_single_node_nccl(exe, gpus=8, timeout_s=1.0, env=env)
    assert obs.status.timed_out and not obs.status.complete
    assert check_nccl_busbw(Observations(nccl=obs), inp())[0].severity is Severity.INCOMPLETE


def test_missing_binary_is_incomplete_never_a_failure(tmp_path):
    obs = run_single_node_nccl(str(tmp_path / "nope" / "all_reduce_perf"), gpus=8, timeout_s=5)
    assert obs.tool_missing and not obs.ran
    (f,) = check_nccl_busbw(Observations(nccl=obs), inp())
    assert f.severity is Severity.INCOMPLETE and "not installed" in f.message
    assert run_single_node_nccl("gpuguard-no-such-binary", 8, 5).tool_missing


def test_no_threshold_is_skipped_not_guessed(tmp_path):
    exe, env = stub(tmp_path)
    obs = run_single_node_nccl(exe, gpus=8, timeout_s=30, min_bytes=1 << 30, max_bytes=1 << 30, env=env)
    (f,) = check_nccl_busbw(Observations(nccl=obs), inp(threshold=None))
    assert f.severity is Severity.SKIP and "no bus-bandwidth threshold" in f.message


def test_argv_is_a_list_for_hostile_paths():
    argv = nccl_tests_argv("/opt/x; rm -rf /", 8, 1, 2)
    assert argv[0] == "/opt/x; rm -rf /" and argv[-2:] == ["-c", "1"]


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_missing_nccl_tests_falls_back_to_torch_gloo_with_the_same_report_shape(tmp_path):
    """nccl-tests absent and `fallback: torch`: the torch.distributed probe runs instead (gloo on this GPU-less
    machine, two ranks), reports the rows nccl-tests would, and the same check judges it. One run: each rank is a
    PyTorch start (~2.5 s of CPU here)."""
    obs = run_single_node_nccl(str(tmp_path / "absent"), gpus=2, timeout_s=120, min_bytes=1 << 20,
                               max_bytes=4 << 20, iterations=3, warmup=1, fallback="torch")
    assert obs.backend == "torch" and obs.exit_code == 0 and obs.status.complete, obs.output_tail
    s = obs.summary()
    assert s["rows"] == 3 and s["out_of_bounds"] == 0 and s["wrong_total"] == 0 and s["ranks"] == 2
    assert s["peak_busbw_gbps"] > 0 and s["avg_busbw_gbps"] > 0 and "gloo" in obs.output_tail
    assert [r.size_bytes for r in obs.result.rows] == [1 << 20, 2 << 20, 4 << 20]
    f = check_nccl_busbw(Observations(nccl=obs), inp(threshold=0.0001))
    assert f[0].severity is Severity.OK


def test_torch_missing_is_reported_as_missing_tool(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'gpuguard torch probe: torch is not installed' >&2\nexit 3\n")
    fake_python.chmod(0o755)
    obs = run_torch_probe(python=str(fake_python), timeout_s=10)
    assert obs.tool_missing and check_nccl_busbw(Observations(nccl=obs), inp())[0].severity is Severity.INCOMPLETE


# --------------------------------------------------------------------------- tier decision


CFG = NcclConfig(tier_enabled=True, only_exclusive=True, first_job_after_reboot=True, tier_interval_h=0)


def test_exclusive_means_every_gpu_of_the_node():
    assert job_is_exclusive(None, tuple(range(8)), 8) and not job_is_exclusive(None, (0, 1), 8)
    assert not job_is_exclusive(None, None, 8) and job_is_exclusive(True, (0,), 8)


def test_tier_runs_once_per_boot_for_exclusive_jobs():
    assert tier_due(replace(CFG, tier_enabled=False), kind="prolog", exclusive=True, boot_id="b", last=None, now=0)[0] is False
    assert tier_due(CFG, kind="prolog", exclusive=False, boot_id="b", last=None, now=0) == \
        (False, "job does not have the whole node (nccl.only_exclusive)")
    assert tier_due(CFG, kind="prolog", exclusive=True, boot_id="b", last=None, now=0)[0] is True
    done = tier_cursor("b", 100.0)
    assert tier_due(CFG, kind="prolog", exclusive=True, boot_id="b", last=done, now=200)[0] is False
    assert tier_due(CFG, kind="prolog", exclusive=True, boot_id="b2", last=done, now=200) == (True, "first job after a reboot")
    assert tier_due(replace(CFG, tier_interval_h=1), kind="prolog", exclusive=True, boot_id="b", last=done, now=3800)[0]
    assert tier_due(replace(CFG, first_job_after_reboot=False), kind="prolog", exclusive=True, boot_id="b", last=done,
                    now=200)[0]
    assert tier_due(CFG, kind="healthcheck", exclusive=True, boot_id="b", last=None, now=0)[0] is False


def test_stub_reads_a_single_scenario_file(tmp_path):
    scen = tmp_path / "one.yaml"
    scen.write_text("instance_type: p5.48xlarge\nnccl: {busbw_gbps: 250}\n")
    exe = install_stub(str(tmp_path / "bin"), str(scen))
    obs = run_single_node_nccl(str(exe), gpus=8, timeout_s=30, min_bytes=8 << 30, max_bytes=8 << 30)
    assert 245 < obs.result.large_busbw()[1] < 252


def test_tier_probes_wire_the_three_probes_with_simulated_tools(tmp_path, monkeypatch):
    from gpuguard.nccl.tier import tier_probes

    scen = tmp_path / "node1.yaml"
    scen.write_text("instance_type: p5.48xlarge\nnccl: {busbw_gbps: 480}\ndcgm: {warn: [{test: software, gpu: 0, severity: 5}]}\n")
    bindir = str(tmp_path / "sim" / "bin")
    tools = {"all_reduce_perf": str(install_stub(bindir, str(scen))),
             "dcgmi": str(install_stub(bindir, str(scen), name="dcgmi", tool="dcgmi"))}
    cfg = NcclConfig(binary="unused", min_bytes=1 << 30, max_bytes=1 << 30, iterations=5, timeout_s=30, dcgmi="dcgmi",
                     dcgm_level=1, dcgm_timeout_s=30)
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    probes = tier_probes(cfg, needs={"nccl", "dcgm", "efa_counters"}, gpus=8, sysfs_root=str(tmp_path / "sys"),
                         binary=tools["all_reduce_perf"], dcgmi=tools["dcgmi"])
    assert [p[0] for p in probes] == ["nccl", "dcgm", "efa_counters"]
    results = {name: fn() for name, fn, _t, _cls in probes}
    assert results["nccl"].result.large_busbw()[1] > 470
    assert [t.status for t in results["dcgm"].tests] == ["warn"]
    assert results["efa_counters"].ports == [] and results["efa_counters"].status.complete
    obs = Observations(nccl=results["nccl"])
    assert check_nccl_busbw(obs, inp())[0].severity is Severity.OK
