"""The gpuguard command line, run as a user would (tests/clirun.py: its entry point, in a process where it needs one)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from clirun import gpuguard

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kernel_log"


def gg(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return gpuguard(*args, input=input)


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
    cfg = tmp_path / "config.yaml"  # the node's store and simulated files in the test's own directory
    cfg.write_text(f"store: {{path: {tmp_path}/state.db}}\nsimulation: {{workdir: {tmp_path}/sim}}\n")
    p = gg("check", "--simulate", scenario, "--dry-run", "--config", str(cfg))
    assert re.search(r" at 20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ - profile ", p.stdout.splitlines()[0]), p.stdout
    doc = json.loads(gg("check", "--simulate", scenario, "--dry-run", "--json", "--config", str(cfg)).stdout)
    assert re.fullmatch(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["started"])


def test_a_config_named_before_the_command_is_the_one_used(tmp_path):
    """`gpuguard --config F CMD` was silently `gpuguard CMD` with the built-in defaults for every command but the
    hooks (argparse let the command's own `--config`, None, overwrite F; the hooks refused the order outright):
    an admin's `gpuguard --config site.yaml check` judged the node against the generic profile. Found on a real
    H200 (bench/real_gpu.py): the site profile never applied."""
    cfg = tmp_path / "site.yaml"
    cfg.write_text(f"node: {{profile: p5.48xlarge}}\nstore: {{path: {tmp_path}/s.db, runtime_dir: {tmp_path}/run}}\n"
                   f"simulation: {{workdir: {tmp_path}/sim}}\nlogging: {{syslog: false}}\n")
    for argv in (["--config", str(cfg), "config"], ["config", "--config", str(cfg)], [f"--config={cfg}", "config"]):
        p = gg(*argv)
        assert p.returncode == 0 and p.stdout.startswith(f"# {cfg}: valid"), (argv, p.stdout[:200], p.stderr)
        assert '"profile": "p5.48xlarge"' in p.stdout, argv
    check = gg("--config", str(cfg), "check", "--dry-run", "--json", "--context", "healthcheck")
    assert json.loads(check.stdout)["profile"] == "p5.48xlarge", check.stderr
    # the lean `xid scan` path and the hooks take it too: a broken file is refused by name, in either order
    bad = tmp_path / "bad.yaml"
    bad.write_text("xid:\n  overrides: {79: sometimes}\n")
    for argv in (["--config", str(bad), "xid", "scan", "--file", str(FIX / "dmesg.txt")],
                 ["xid", "scan", "--file", str(FIX / "dmesg.txt"), "--config", str(bad)]):
        p = gg(*argv)
        assert p.returncode == 2 and str(bad) in p.stderr and "79" in p.stderr, (argv, p.stderr)
    scen = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "healthy-p5.yaml"
    hook = gg("--config", str(cfg), "healthcheck", "--simulate", str(scen))
    assert hook.returncode == 0, hook.stderr
    assert (tmp_path / "s.db").exists()  # the hook's run went to F's store, not /var/lib/gpuguard's


def test_hoist_config():
    from gpuguard.util.cliargs import hoist_config

    assert hoist_config(["--config", "F", "prolog"]) == (["--config", "F"], ["prolog"])
    assert hoist_config(["--config=F", "xid", "scan"]) == (["--config", "F"], ["xid", "scan"])
    assert hoist_config(["prolog", "--config", "F"]) == ([], ["prolog", "--config", "F"])
    assert hoist_config(["--config"]) == ([], ["--config"])  # argparse says what is missing
