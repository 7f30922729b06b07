"""DCGM diagnostics: the parser on recorded `dcgmi diag -j` outputs (3.x and 4.x shapes), the runner against a
real executable (missing tool, host engine down, hang, failing exit code), and the dcgm.diag check."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from clirun import gpuguard

from gpuguard.checks import CheckInput, get_check
from gpuguard.model import Action, Observations, Severity
from gpuguard.probes.dcgm import DcgmParseError, normalise_status, parse_dcgm_diag, run_dcgm_diag
from gpuguard.profiles import load_profile

check_dcgm_diag = get_check("dcgm.diag")  # the check, with its spec bound

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def inp(**params) -> CheckInput:
    return CheckInput(profile=load_profile("p5.48xlarge"), params=params, kind="prolog")


def test_dcgm3_all_pass_with_leading_garbage_and_nulls():
    obs = parse_dcgm_diag(fixture("dcgm3_pass_8gpu_leading_warning.json"))
    assert obs.version == "3.1.0" and obs.error is None
    assert [t.name for t in obs.tests][:3] == ["Denylist", "NVML Library", "CUDA Main Library"]
    assert len(obs.tests) == 10 and {t.status for t in obs.tests} == {"pass"}
    software = obs.tests[-1]
    assert software.category == "Custom" and [r.gpus for r in software.results] == [[i] for i in range(8)]
    assert obs.tests[0].results[0].gpus == list(range(8))


def test_dcgm4_config_failure_keeps_dcgms_severity_and_message():
    obs = parse_dcgm_diag(fixture("dcgm4_gb10_level1_persistence_config.json"))
    assert (obs.version, obs.driver_version) == ("4.2.3", "580.82.09")
    (t,) = obs.tests
    assert (t.category, t.name, t.status, t.failed_gpus, t.severities) == ("Deployment", "software", "fail", [0], {5})
    assert t.messages[0].startswith("Persistence Mode: Persistence mode for GPU 0 is disabled")
    assert "SRAM Threshold" in t.summary_info[0] and t.results[0].error_ids == [29]


def test_dcgm4_partial_skip_and_pass_with_info():
    skip = parse_dcgm_diag(fixture("dcgm4_gb10_level2_partial_skip.json"))
    assert [(t.name, t.status) for t in skip.tests] == [("software", "fail"), ("memory", "skip"), ("pcie", "skip")]
    allowed = parse_dcgm_diag(fixture("dcgm4_gb10_level2_plugins_allowed.json"))
    assert [(t.name, t.status) for t in allowed.tests] == [("software", "fail"), ("memory", "pass"), ("pcie", "pass")]
    assert allowed.tests[2].results[0].info[0].startswith("GPU to Host bandwidth")


def test_statuses_normalised_and_unknown_is_never_ok():
    assert [normalise_status(s) for s in ("PASS", "Pass", "FAIL", "Warn", "SKIPPED", "Not Run", "weird")] == \
        ["pass", "pass", "fail", "warn", "skip", "skip", "warn"]


def test_parse_errors_are_clear():
    with pytest.raises(DcgmParseError, match="no JSON object"):
        parse_dcgm_diag("Error: Unable to connect to host engine. Host engine connection invalid/disconnected.\n")
    with pytest.raises(DcgmParseError, match="invalid JSON"):
        parse_dcgm_diag('{"DCGM Diagnostic": {')
    with pytest.raises(DcgmParseError, match="no 'DCGM GPU Diagnostic'"):
        parse_dcgm_diag('{"something": 1}')
    runtime = parse_dcgm_diag('{"DCGM Diagnostic": {"runtime_error": "Couldn\'t find the ubergemm executable"}}')
    assert runtime.tests == [] and "ubergemm" in runtime.error


def _hardware_failure(severity: int) -> str:
    """The 4.x fixture with the memory test failing on GPU 3 at a hardware severity."""
    doc = json.loads(fixture("dcgm4_gb10_level2_plugins_allowed.json").split("\n", 2)[2])
    mem = doc["DCGM Diagnostic"]["test_categories"][1]["tests"][0]
    mem["results"][0].update(entity_id=3, status="Fail", warnings=[{
        "error_category": 0, "error_id": 16, "error_severity": severity,
        "warning": "Pending page retirements together with a DBE were detected on GPU 3."}])
    mem["test_summary"]["status"] = "Fail"
    return json.dumps(doc)


# --------------------------------------------------------------------------- the check


def test_check_pass():
    f = check_dcgm_diag(Observations(dcgm=parse_dcgm_diag(fixture("dcgm3_pass_8gpu_leading_warning.json"))), inp())
    assert [x.severity for x in f] == [Severity.OK] and "10 tests" in f[0].message


def test_check_config_failure_is_a_warning_not_a_drain():
    f = check_dcgm_diag(Observations(dcgm=parse_dcgm_diag(fixture("dcgm4_gb10_level1_persistence_config.json"))), inp())
    assert [x.severity for x in f] == [Severity.WARN] and "configuration, not hardware" in f[0].message


@pytest.mark.parametrize("severity,action", [(6, Action.RESET), (2, Action.REPLACE), (4, Action.DRAIN)])
def test_check_hardware_failure_maps_dcgm_severity_to_action(severity, action):
    obs = parse_dcgm_diag(_hardware_failure(severity))
    f = [x for x in check_dcgm_diag(Observations(dcgm=obs), inp()) if x.severity is Severity.FAIL]
    assert len(f) == 1 and f[0].keyword == "DCGM" and f[0].action is action and f[0].gpu == 3
    assert "memory failed on GPU 3" in f[0].message and "DBE" in f[0].message


def test_check_everything_skipped_is_incomplete_and_ignore_list():
    obs = parse_dcgm_diag(fixture("dcgm4_gb10_level2_partial_skip.json"))
    f = check_dcgm_diag(Observations(dcgm=obs), inp(ignore_tests=["software"]))
    assert [x.severity for x in f] == [Severity.INCOMPLETE] and "skipped every test" in f[0].message


def test_check_missing_tool_and_not_run_are_incomplete():
    missing = run_dcgm_diag("/nonexistent/dcgmi", 1, 5)
    assert missing.tool_missing and not missing.status.complete
    f = check_dcgm_diag(Observations(dcgm=missing), inp())
    assert [x.severity for x in f] == [Severity.INCOMPLETE] and "not installed" in f[0].message
    assert check_dcgm_diag(Observations(), inp())[0].severity is Severity.INCOMPLETE


# --------------------------------------------------------------------------- the runner (a real executable)


def _tool(tmp_path: Path, body: str) -> str:
    path = tmp_path / "dcgmi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_runner_parses_output_even_when_dcgmi_exits_nonzero(tmp_path):
    out = tmp_path / "out.json"
    out.write_text(_hardware_failure(6))
    tool = _tool(tmp_path, f'echo "$@" > {tmp_path}/argv\ncat {out}\nexit 226\n')
    obs = run_dcgm_diag(tool, level=2, timeout_s=10, gpus=[0, 1])
    assert (tmp_path / "argv").read_text().split() == ["diag", "-r", "2", "-j", "-i", "0,1"]
    assert obs.exit_code == 226 and obs.status.complete and obs.level == 2
    assert [t.status for t in obs.tests if t.name == "memory"] == ["fail"]


def test_runner_host_engine_down_is_an_error_not_a_failure(tmp_path):
    tool = _tool(tmp_path, 'echo "Error: unable to establish a connection to the specified host: localhost" >&2\nexit 255\n')
    obs = run_dcgm_diag(tool, 1, 10)
    assert not obs.status.complete and "host: localhost" in obs.error and obs.tests == []
    assert check_dcgm_diag(Observations(dcgm=obs), inp())[0].severity is Severity.INCOMPLETE


def test_runner_timeout_kills_the_tool(tmp_path):
    tool = _tool(tmp_path, "sleep 30\n")
    obs = run_dcgm_diag(tool, 1, timeout_s=0.3)
    assert obs.status.timed_out and not obs.status.complete and obs.status.duration_s < 5


def test_simulated_dcgmi_drives_the_real_runner_and_check(tmp_path, monkeypatch):
    from devtools.nccl_tests_stub import install_stub

    scen = tmp_path / "scen"
    scen.mkdir()
    (scen / "node1.yaml").write_text("instance_type: p5.48xlarge\n"
                                     "dcgm: {fail: [{test: memory, gpu: 3, severity: 6, message: DBE on GPU 3}]}\n")
    (scen / "default.yaml").write_text("instance_type: p5.48xlarge\ndcgm: {error: host engine not running}\n")
    exe = install_stub(str(tmp_path / "bin"), str(scen), name="dcgmi", tool="dcgmi")
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    obs = run_dcgm_diag(str(exe), level=2, timeout_s=20)
    assert obs.exit_code == 226 and [t.name for t in obs.tests] == ["software", "memory", "pcie"]
    (f,) = [x for x in check_dcgm_diag(Observations(dcgm=obs), inp()) if x.severity is Severity.FAIL]
    assert f.action is Action.RESET and f.gpu == 3 and "DBE on GPU 3" in f.message
    monkeypatch.setenv("SLURMD_NODENAME", "node2")  # falls back to default.yaml: the host engine is down
    down = run_dcgm_diag(str(exe), level=1, timeout_s=20)
    assert down.tests == [] and "host engine not running" in down.error


# --------------------------------------------------------------------------- the text table (issue 16)


def _verdict(obs):
    return [(f.severity, f.action, f.message) for f in check_dcgm_diag(Observations(dcgm=obs), inp())]


def test_text_table_per_test_and_per_gpu():
    """NVIDIA/nccl-tests#264: `dcgmi diag --run 3` as an admin pasted it; `gpuguard dcgm parse` said "no JSON
    object". Every test, its category and status; GPU Memory failed on all 8 GPUs, each with its own message."""
    obs = parse_dcgm_diag(fixture("dcgm3_text_r3_cuinit_fail_all.txt"))
    assert (obs.version, obs.driver_version) == ("3.3.8", "560.35.03")
    assert [(t.category, t.name, t.status) for t in obs.tests][8:] == [
        ("Deployment", "Inforom", "pass"), ("Integration", "PCIe", "skip"), ("Hardware", "GPU Memory", "fail"),
        ("Stress", "Memory Bandwidth", "skip"), ("Stress", "EUD Test", "skip")]
    memory = obs.tests[10]
    assert memory.failed_gpus == list(range(8))
    assert memory.results[3].warnings == ["GPU 3 Error using CUDA API cuInit Check DCGM and system logs for errors. "
                                          "Reset GPU. Restart DCGM. Rerun diagnostics. Unable to initialize CUDA "
                                          "library: 'system not yet initialized'. . Please check if a CUDA sample "
                                          "program can be run successfully on this host. Refer to "
                                          "https://github.com/nvidia/cuda-samples"]
    # an Info row is information, not a warning (persistence mode off while the test passed)
    persistence = obs.tests[4]
    assert persistence.status == "pass" and persistence.summary_info[0].startswith(
        'Persistence mode for GPU 0 is disabled. Enable persistence mode by running "nvidia-smi -i <gpuId> -pm 1 "')


def test_text_table_gives_the_same_verdict_as_the_json():
    """The same run as `dcgmi diag -j` would print it (DCGM 3.x shape, derived from the table): the check reaches
    the same findings, GPUs and action from either."""
    text = parse_dcgm_diag(fixture("dcgm3_text_r3_cuinit_fail_all.txt"))
    js = parse_dcgm_diag(fixture("dcgm3_text_r3_cuinit_fail_all.derived.json"))
    assert [(t.name, t.status, t.failed_gpus, t.messages) for t in text.tests] == \
        [(t.name, t.status, t.failed_gpus, t.messages) for t in js.tests]
    verdict = _verdict(text)
    assert verdict == _verdict(js)
    assert [(s, a) for s, a, _ in verdict] == [(Severity.FAIL, Action.DRAIN)]
    assert "GPU Memory failed on GPU 0,1,2,3,4,5,6,7" in verdict[0][2]


def test_text_table_dcgm4_per_gpu_lines():
    """NVIDIA/DCGM#253 (DCGM 4.2.3): each test, then one line per GPU; pcie failed as a test (an internal error,
    no GPU named) while every GPU line says Pass."""
    obs = parse_dcgm_diag(fixture("dcgm4_text_r2_pcie_internal_error.txt"))
    assert obs.version == "4.2.3" and [(t.name, t.status) for t in obs.tests] == [
        ("software", "pass"), ("memory", "pass"), ("pcie", "fail")]
    pcie = obs.tests[2]
    assert pcie.failed_gpus == [] and len(pcie.messages) == 4
    assert sorted(g for r in pcie.results if r.status == "pass" for g in r.gpus) == [0, 1, 2, 3]
    assert pcie.messages[0] == ("There was an internal error during the test: 'A child process (152) exited with "
                                "non-zero status 1' Check DCGM and system logs for errors. Reset GPU. Restart "
                                "DCGM. Rerun diagnostics.")
    [(severity, action, message)] = _verdict(obs)
    assert (severity, action) == (Severity.FAIL, Action.DRAIN) and message.startswith("DCGM pcie failed:")


def test_a_pasted_fragment_per_gpu_groups():
    """stas00/ml-engineering (debug.md): the failing rows only, `Pass - GPUs: 1, ..., 7` then `Fail - GPU: 0`,
    the last row cut: GPU 0 failed, the others passed."""
    obs = parse_dcgm_diag(fixture("dcgm3_text_r2_gpu0_thermal_fragment.txt"))
    [t] = obs.tests
    assert (t.name, t.status, t.failed_gpus) == ("GPU Memory", "fail", [0])
    assert sorted(g for r in t.results if r.status == "pass" for g in r.gpus) == [1, 2, 3, 4, 5, 6, 7]
    assert t.messages[0].startswith("GPU 0 Thermal violations totaling 13.3 seconds started at 9.7 seconds")
    [(severity, action, message)] = _verdict(obs)
    assert severity == Severity.FAIL and "on GPU 0" in message


def test_dcgm_parse_cli_reads_the_table(tmp_path):
    p = gpuguard("dcgm", "parse", "--json", str(FIXTURES / "dcgm3_text_r3_cuinit_fail_all.txt"))
    assert p.returncode == 1, p.stderr  # a test failed
    out = json.loads(p.stdout)
    assert out["version"] == "3.3.8" and [t["failed_gpus"] for t in out["tests"] if t["status"] == "fail"] == \
        [list(range(8))]
    garbage = tmp_path / "x.txt"
    garbage.write_text("dcgmi: command not found\n")
    p = gpuguard("dcgm", "parse", str(garbage))
    assert p.returncode == 1 and "no JSON object" in p.stderr
