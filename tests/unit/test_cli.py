"""The gpuguard command line, run as a user would (subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kernel_log"


def gg(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], capture_output=True, text=True, timeout=60,
                          input=input)


def test_xid_scan_json_shape_on_real_dmesg():
    p = gg("xid", "scan", "--file", str(FIX / "dmesg.txt"), "--json")
    out = json.loads(p.stdout)
    ev = out["events"]
    assert ev and all(isinstance(e["code"], int) and isinstance(e["fatal"], bool) for e in ev)
    first = ev[0]
    assert (first["code"], first["pci"], first["fatal"]) == (13, "0000:43:00", False)
    assert p.returncode == (1 if any(e["fatal"] for e in ev) else 0)


def test_xid_scan_ignores_forged_lines_and_reads_stdin():
    text = ("Nov 20 10:11:12 gpu-17 kernel: [ 1234.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
            "Nov 20 10:11:13 gpu-17 alice: NVRM: Xid (PCI:0000:53:00): 79, pid=2, name=y, GPU has fallen off the bus.\n")
    out = json.loads(gg("xid", "scan", "--file", "-", "--json", input=text).stdout)
    assert [(e["code"], e["pci"], e["fatal"]) for e in out["events"]] == [(79, "0000:3b:00", True)]
    assert out["rejected_non_kernel"] == 1


def test_xid_scan_text_and_every_format_fixture():
    for name in ("dmesg.txt", "syslog.txt", "kmsg.txt", "journal_json.txt", "bare.txt"):
        p = gg("xid", "scan", "--file", str(FIX / name))
        assert "Xid events" in p.stdout, (name, p.stderr)


def test_xid_explain():
    p = gg("xid", "explain", "79")
    assert p.returncode == 0 and "fallen off the bus" in p.stdout and "reboot" in p.stdout
    assert "app" in gg("xid", "explain", "13").stdout


def test_bad_config_exits_2_naming_line_and_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("node:\n  profile: p5.48xlarge\npolicy:\n  on_failure: sometimes\n")
    p = gg("config", "--config", str(cfg))
    assert p.returncode == 2
    assert f"{cfg}: line 4: policy.on_failure: expected one of drain, report, got 'sometimes'" in p.stderr
    cfg.write_text("node:\n  profile: p5.48xlarge\n")
    assert gg("config", "--config", str(cfg)).returncode == 0


def test_slurm_conf_and_profiles():
    out = gg("slurm-conf", "--prefix", "/opt/gg").stdout
    for line in ("Prolog=/opt/gg/libexec/gpuguard/gpuguard-prolog", "PrologFlags=Alloc",
                 "SchedulerParameters=nohold_on_prolog_fail", "PrologEpilogTimeout=60",
                 "HealthCheckProgram=/opt/gg/libexec/gpuguard/gpuguard-healthcheck", "HealthCheckNodeState=ANY,CYCLE"):
        assert line in out.splitlines()
    assert sum(1 for ln in out.splitlines() if ln.startswith("# ")) >= 9  # a why for every line
    assert "p5.48xlarge" in gg("profiles").stdout
    show = gg("profiles", "p5en.48xlarge").stdout
    assert "efa_devices" in show and "NVIDIA H200" in show


def test_history_after_a_check(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"store: {{path: {tmp_path}/s.db}}\nsimulation: {{workdir: {tmp_path}/sim}}\nlogging: {{syslog: false}}\n")
    scen = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "missing-gpu.yaml"
    gg("check", "--config", str(cfg), "--simulate", str(scen), "--dry-run", "--node", "n9")
    out = json.loads(gg("history", "--config", str(cfg), "--json").stdout)
    assert out["runs"][0]["node"] == "n9" and out["runs"][0]["verdict"] == "drain"
    assert out["drains"][0]["outcome"] == "skipped"
    assert "missing-gpu" not in gg("history", "--config", str(cfg)).stderr


# --------------------------------------------------------------------------- small things an admin trips over


def test_version():
    from gpuguard import __version__

    for argv in (["--version"], ["-V"], ["--config", "/nonexistent.yaml", "--version"]):
        p = gg(*argv)
        assert (p.returncode, p.stdout.strip(), p.stderr) == (0, f"gpuguard {__version__}", ""), argv


FILE_COMMANDS = [  # every command that reads an input file; FILE is replaced by the path
    ("xid", "scan", "--file", "FILE"),
    ("nccl", "parse", "FILE"),
    ("efa", "parse-fi-info", "FILE"),
    ("dcgm", "parse", "FILE"),
    ("lint", "FILE"),
    ("render", "torchrun.sbatch.j2", "-c", "FILE"),
    ("trainlog", "FILE"),
    ("config", "--config", "FILE"),
]


def _one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    err = p.stderr.strip()
    assert "Traceback" not in p.stderr and len(err.splitlines()) == 1, p.stderr
    return err


def test_a_missing_input_file_is_one_line_and_exit_2(tmp_path):
    """Exit 1 means "would drain" (a fatal Xid, a failed test): a file that is not there must not look like it."""
    for bad in (tmp_path / "missing.log", tmp_path):  # not there; a directory
        for cmd in FILE_COMMANDS:
            p = gg(*[str(bad) if a == "FILE" else a for a in cmd])
            assert p.returncode == 2, (cmd, bad, p.returncode, p.stderr)
            assert str(bad) in _one_line_error(p), (cmd, p.stderr)


def test_deeply_nested_json_and_yaml_are_a_clear_error(tmp_path):
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"results": ' + "[" * 100000 + "\n")
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("a: " + "[" * 100000 + "\n")
    for cmd, path in ((("nccl", "parse", "FILE"), deep_json), (("dcgm", "parse", "FILE"), deep_json),
                      (("config", "--config", "FILE"), deep_yaml), (("config", "--config", "FILE"), deep_json),
                      (("render", "torchrun.sbatch.j2", "-c", "FILE"), deep_yaml)):
        p = gg(*[str(path) if a == "FILE" else a for a in cmd])
        assert p.returncode == 2, (cmd, p.returncode, p.stderr[-500:])
        assert "nest" in _one_line_error(p), (cmd, p.stderr)


def test_check_report_times_are_utc_iso(tmp_path):
    import re

    scenario = str(Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "healthy-p5.yaml")
    cfg = tmp_path / "c.yaml"  # the test's own store: never the node's /var/lib/gpuguard/state.db
    cfg.write_text(f"store: {{path: {tmp_path}/s.db}}\nsimulation: {{workdir: {tmp_path}/sim}}\nlogging: {{syslog: false}}\n")
    p = gg("check", "--config", str(cfg), "--simulate", scenario, "--dry-run")
    assert re.search(r" at 20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ - profile ", p.stdout.splitlines()[0]), p.stdout
    doc = json.loads(gg("check", "--config", str(cfg), "--simulate", scenario, "--dry-run", "--json").stdout)
    assert re.fullmatch(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["started"])
