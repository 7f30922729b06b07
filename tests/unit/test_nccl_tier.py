"""The optional slow tier wired into the prolog: it runs for a job that has the whole node, once per boot,
through the simulated nccl-tests binary, and a slow node is drained with keyword NCCL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from devtools.nccl_tests_stub import install_stub
from gpuguard.slurm.reason import parse_reason

SCEN = Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def setup(tmp_path: Path, nccl: dict, tier: bool = True) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    scen = tmp_path / "node.yaml"
    data = yaml.safe_load((SCEN / "healthy-p5.yaml").read_text())
    data["nccl"] = nccl
    scen.write_text(yaml.safe_dump(data))
    cfg = tmp_path / "config.yaml"
    bindir = str(tmp_path / "bin")
    tools = {"all_reduce_perf": str(install_stub(bindir, str(scen))),
             "dcgmi": str(install_stub(bindir, str(scen), name="dcgmi", tool="dcgmi"))}
    cfg.write_text(yaml.safe_dump({
        "store": {"path": str(tmp_path / "state.db")},
        "simulation": {"workdir": str(tmp_path / "sim"), "tools": tools},
        "logging": {"syslog": False}, "nccl": {"tier_enabled": tier, "timeout_s": 30},
        "checks": {"nccl.busbw": {"min_busbw_gbps": 300}}}))
    return cfg, scen


def check(cfg: Path, scen: Path, gpus: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "gpuguard", "check", "--config", str(cfg), "--simulate", str(scen),
                        "--context", "prolog", "--gpus", gpus, "--json", "--node", "n1"],
                       capture_output=True, text=True, timeout=120)
    return json.loads(p.stdout)


def nccl_findings(out: dict) -> list[dict]:
    return [f for f in out["findings"] if f["check_id"] == "nccl.busbw"]


def test_slow_node_is_drained_by_the_tier_once_per_boot(tmp_path):
    cfg, scen = setup(tmp_path, {"slow_factor": 0.4})
    first = check(cfg, scen, "0-7")
    [f] = nccl_findings(first)
    # no Slurm here: the drain-storm guard cannot take its census, so a prolog's drain for a check that could fail on
    # every node at once (a threshold) is held and paged (verdict warn, reported only) rather than applied
    assert f["severity"] == "fail" and first["action"] == "drain" and first["reported_only"]
    r = parse_reason(first["reason"])
    assert (r.check_id, r.keyword) == ("nccl.busbw", "NCCL") and "159.5 GB/s < 300 GB/s" in r.detail  # ~400 GB/s x 0.4
    again = check(cfg, scen, "0-7")
    assert nccl_findings(again) == []  # already ran in this boot: the fast tier only


def test_tier_skips_shared_jobs_and_is_off_by_default(tmp_path):
    cfg, scen = setup(tmp_path, {"slow_factor": 0.4})
    assert nccl_findings(check(cfg, scen, "0-3")) == []  # the job does not have the whole node
    cfg2, scen2 = setup(tmp_path / "off", {"slow_factor": 0.4}, tier=False)
    assert nccl_findings(check(cfg2, scen2, "0-7")) == []


def test_healthy_node_passes_the_tier(tmp_path):
    cfg, scen = setup(tmp_path, {"busbw_gbps": 390})
    out = check(cfg, scen, "0-7")
    [f] = nccl_findings(out)
    assert f["severity"] == "ok" and out["verdict"] == "pass"
