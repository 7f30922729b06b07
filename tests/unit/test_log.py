"""Hostile strings stay inert in the hooks' log (gpuguard.util.log escapes at the sink): a process name, hostname or
kernel-log line with terminal escapes, carriage returns or other control characters reaches neither the log file
nor stderr raw. The end-to-end test runs the real prolog on a simulated node whose GPU holds a real process that
renamed itself (prctl PR_SET_NAME, as any user can)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.util.log import HookLog, escape_text

from simnode import gpuguard_dirs

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
RAW = set(map(chr, range(0x20))) | {"\x7f"} | set(map(chr, range(0x80, 0xa0))) | {"\u202e", "\u2066", "\u200b"}


def inert(text: str) -> bool:
    return not any(c in RAW for c in text.replace("\n", ""))


@given(st.text())
def test_escaped_text_is_one_line_with_nothing_raw(text):
    out = escape_text(text)
    assert inert(out) and "\n" not in out and out.isprintable()


def test_escapes_are_readable_and_printable_text_is_kept():
    assert escape_text("pid 4242 \x1b[31mEVIL\rok\x07") == "pid 4242 \\x1b[31mEVIL\\x0dok\\x07"
    assert escape_text("node-é 😀 ok") == "node-é 😀 ok"
    assert escape_text("line one\nline two") == "line one | line two"
    assert escape_text("\u202eexe.sh") == "\\u202eexe.sh"


def test_the_log_file_and_stderr_get_escaped_lines(tmp_path, capsys):
    log = tmp_path / "gpuguard.log"
    HookLog(use_syslog=False, path=str(log)).warning("process \x1b]0;owned\x07 on host \x1b[2Jnode\r7")
    err = capsys.readouterr().err
    for text in (log.read_text(), err):
        assert "\\x1b]0;owned\\x07" in text and "\\x1b[2Jnode\\x0d7" in text
        assert inert(text)


def _renamed_process(name: bytes) -> subprocess.Popen[bytes]:
    code = ("import ctypes, sys, time; libc = ctypes.CDLL(None); "
            f"libc.prctl(15, ctypes.c_char_p({name!r}), 0, 0, 0); sys.stdout.write('ok\\n'); sys.stdout.flush(); "
            "time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ok\n"
    return p


def test_a_hostile_process_name_reaches_the_prolog_log_escaped(tmp_path):
    from gpuguard.simulate.build import build_fake_nvml
    from gpuguard.simulate.scenario import inject

    proc = _renamed_process(b"\x1b[31mEVIL\rok")
    try:
        assert Path(f"/proc/{proc.pid}/comm").read_bytes() == b"\x1b[31mEVIL\rok\n"
        scenario = tmp_path / "node.yaml"
        shutil.copy(SCENARIOS / "healthy-p5.yaml", scenario)
        inject(str(scenario), processes=[(0, proc.pid)])
        # the simulated node's /proc (sources.procfs_root) holds what the real one says about that process
        comm = tmp_path / "sim" / "n1" / "proc" / str(proc.pid) / "comm"
        comm.parent.mkdir(parents=True)
        comm.write_bytes(Path(f"/proc/{proc.pid}/comm").read_bytes())
        log = tmp_path / "gpuguard.log"
        conf = tmp_path / "config.yaml"
        conf.write_text(yaml.safe_dump({
            "store": {"path": str(tmp_path / "state" / "{node}.db")}, "logging": {"syslog": False, "file": str(log)},
            "simulation": {"workdir": str(tmp_path / "sim"), "fake_nvml": str(build_fake_nvml())},
            "slurm": {"scontrol": "/bin/true"}}))
        env = {**gpuguard_dirs(), "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "0",
               "CUDA_VISIBLE_DEVICES": "0",
               "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "PATH": "/usr/bin:/bin"}
        p = subprocess.run([sys.executable, "-m", "gpuguard", "prolog", "--config", str(conf), "--simulate",
                            str(scenario)], capture_output=True, text=True, timeout=120, env=env)
        text = log.read_text()
        assert "leftover process(es)" in text and "\\x1b[31mEVIL" in text, text + p.stderr
        assert inert(text) and inert(p.stderr)
    finally:
        proc.kill()
        proc.wait()

