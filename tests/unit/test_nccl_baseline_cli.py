"""Baselines (robust threshold proposals from the fleet's distribution, stored samples) and the command lines:
`gpuguard nccl parse`, `efa parse-fi-info`, `dcgm parse`, `baseline ...`, the config section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import gpuguard

from gpuguard.cli.main import FEATURE_COMMANDS, main
from gpuguard.config.schema import ConfigError
from gpuguard.siteconfig import parse_config
from gpuguard.nccl import history
from gpuguard.nccl.baseline import best_for, config_snippet, percentile, propose, propose_threshold

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def test_threshold_is_robust_to_the_slow_nodes_it_must_catch():
    healthy = [480.1, 482.3, 479.0, 481.7, 483.2, 478.8, 480.9, 481.1, 479.9, 482.0]
    thr, st = propose_threshold(healthy + [160.0, 171.0])  # two bad nodes in the sample
    assert st["median"] == pytest.approx(480.5, abs=0.6)
    assert 450 < thr < 470  # the 5% margin dominates a tight fleet; the outliers do not drag it down
    assert thr > 171.0


def test_spread_widens_the_threshold_and_few_samples_give_none():
    noisy = [400, 430, 370, 415, 385, 440, 360, 405]
    thr, _ = propose_threshold(noisy, k=3.0, margin_pct=1.0)
    assert thr < 340  # 3 robust sigmas below the median
    assert propose_threshold([480.0, 481.0], min_samples=5)[0] is None
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([7], 5) == 7


def test_propose_groups_by_profile_nodes_and_size():
    rows = [{"profile": "p5", "n_nodes": 2, "size_bytes": s, "busbw_gbps": v, "backend": "nccl-tests"}
            for s, v in [(1 << 30, 440), (1 << 30, 445), (1 << 30, 442), (16 << 30, 480), (16 << 30, 482),
                         (16 << 30, 479)]]
    # a torch pre-flight's samples (another collective) at a size of their own: never the sweep's threshold
    rows += [{"profile": "p5", "n_nodes": 4, "size_bytes": 1 << 22, "busbw_gbps": 90.0, "backend": "nccl"}] * 3
    props = propose(rows, min_samples=3)
    assert [(p.size_bytes, p.samples) for p in props if p.backend == "nccl-tests"] == [(1 << 30, 3), (16 << 30, 3)]
    assert best_for(props, "p5", 2).size_bytes == 16 << 30 and best_for(props, "p5", 4, backend="nccl-tests") is None
    snippet = config_snippet(props)
    assert "sweep_busbw_by_nodes:" in snippet and "    2: " in snippet and "    4: " not in snippet


def run_cli(*args: str, config: Path) -> tuple[int, str, str]:
    p = gpuguard(*args, env={"GPUGUARD_CONFIG": str(config), "PATH": "/usr/bin:/bin"})
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    c = tmp_path / "config.yaml"
    c.write_text(f"store: {{path: '{tmp_path}/state/{{node}}.db'}}\nnccl: {{baseline_min_samples: 3}}\n"
                 "logging: {syslog: false}\n")
    return c


def test_cli_nccl_parse_json_report_shape(cfg):
    rc, out, _ = run_cli("nccl", "parse", str(FIX / "nccl" / "mpirun_tag_output_p4d_legacy.txt"), "--json", config=cfg)
    s = json.loads(out)
    assert rc == 0 and (s["rows"], s["peak_busbw_gbps"], s["avg_busbw_gbps"], s["out_of_bounds"]) == (28, 32.71, 7.801, 0)
    rc, out, err = run_cli("nccl", "parse", str(FIX / "efa" / "fi_info_legacy_2020.txt"), config=cfg)
    assert rc == 1 and "no nccl-tests table" in err
    rc, _, err = run_cli("nccl", "parse", "/nonexistent", config=cfg)
    assert rc == 2 and "cannot read /nonexistent" in err


@pytest.mark.parametrize("name,devices", [("fi_info_legacy_2020.txt", 1), ("fi_info_modern_p4de_4dev.txt", 4),
                                          ("fi_info_libfabric2_efa_direct.txt", 1), ("fi_info_no_provider.txt", 0)])
def test_cli_efa_parse_fi_info_counts_each_device_once(cfg, name, devices):
    rc, out, _ = run_cli("efa", "parse-fi-info", str(FIX / "efa" / name), "--json", config=cfg)
    data = json.loads(out)
    assert data["devices"] == devices and len(data["domains"]) == devices
    assert rc == (0 if devices else 1)


def test_cli_dcgm_parse(cfg):
    rc, out, _ = run_cli("dcgm", "parse", str(FIX / "dcgm" / "dcgm4_gb10_level1_persistence_config.json"), "--json",
                         config=cfg)
    data = json.loads(out)
    assert rc == 1 and data["version"] == "4.2.3"
    assert data["tests"][0] | {"messages": None, "info": None} == {
        "category": "Deployment", "test": "software", "status": "fail", "failed_gpus": [0], "severity": "CONFIG",
        "messages": None, "info": None}
    rc, out, _ = run_cli("dcgm", "parse", str(FIX / "dcgm" / "dcgm3_pass_8gpu_leading_warning.json"), config=cfg)
    assert rc == 0 and "10 tests" in out


def test_cli_baseline_record_show_propose(cfg, tmp_path):
    files = [str(FIX / "nccl" / "p5_2node_srun_label.txt")] * 3
    rc, out, _ = run_cli("baseline", "record", "--profile", "p5.48xlarge", "--nodes", "2", *files, config=cfg)
    assert rc == 0 and "recorded 45 samples" in out  # 15 sizes >= 1 MiB, three files
    rc, out, _ = run_cli("baseline", "propose", "--json", config=cfg)
    (p,) = json.loads(out)
    assert (p["profile"], p["n_nodes"], p["size_bytes"], p["samples"], p["median"]) == ("p5.48xlarge", 2, 17179869184, 3, 487.09)
    assert p["threshold_gbps"] == pytest.approx(487.09 * 0.95, abs=0.01)
    rc, out, _ = run_cli("baseline", "propose", config=cfg)
    assert "sweep_busbw_by_nodes:" in out and "2: 462.74" in out
    with history.open_history(str(tmp_path / "state" / "fleet.db")) as st:
        assert len(history.samples(st, profile="p5.48xlarge", size_bytes=1 << 30)) == 3


def test_sweep_without_threshold_is_a_usage_error(cfg):
    rc, _, err = run_cli("nccl", "sweep", "--nodes", "node[1-2]", "--no-drain", config=cfg)
    assert rc == 2 and "no bus-bandwidth threshold" in err


def test_config_section_validates():
    c = parse_config("nccl:\n  tier_enabled: true\n  sweep_method: bisect\n  sweep_busbw_by_nodes: {2: 380}\n")
    assert c.nccl.tier_enabled is True and c.nccl.sweep_method == "bisect"
    assert c.nccl.dcgm_level == 1 and c.nccl.binary == "all_reduce_perf"
    with pytest.raises(ConfigError, match="line 2: nccl.sweep_method: expected one of pairwise, bisect"):
        parse_config("nccl:\n  sweep_method: random\n")
    with pytest.raises(ConfigError, match="did you mean 'dcgm_level'"):
        parse_config("nccl:\n  dcgm_levle: 2\n")


def test_commands_registered_and_kept_off_the_hook_path():
    assert {FEATURE_COMMANDS[c] for c in ("nccl", "efa", "dcgm", "baseline")} == {
        "gpuguard.nccl.cli", "gpuguard.nccl.efa_cli", "gpuguard.nccl.dcgm_cli", "gpuguard.nccl.baseline_cli"}
    # only when the optional tier is due (gpuguard.nccl.tier: a pure decision) is on the hooks' path (the `nccl:`
    # config section is the config package's now): not the probe, its parser and their YAML
    code = ("import sys, gpuguard.cli.main, gpuguard.pipeline.run; "
            "assert not [m for m in sys.modules if m.startswith('gpuguard.nccl')"
            " and m not in ('gpuguard.nccl', 'gpuguard.nccl.tier')], 'imported on the hot path'; "
            "assert 'yaml' not in sys.modules and 'http.client' not in sys.modules, 'imported on the hot path'")
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


def test_usage_without_subcommand(capsys):
    assert main(["baseline"]) == 2
    assert "usage: gpuguard baseline" in capsys.readouterr().err
