"""Fabric sanity at job start: which network NCCL loaded on every rank, from NCCL's own INIT/NET debug lines
(real excerpts in tests/fixtures/templates/nccl/, sources in its README)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

from gpuguard.templates.fabric import judge, parse_nccl_log, read_attempt, run_check, summary

NCCL = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "nccl"


def test_parse_efa_and_socket_ranks():
    efa = parse_nccl_log((NCCL / "p5en_libfabric.log").read_text(), "a.log")
    assert (efa.host, efa.network, efa.kind) == ("8h200-2", "Libfabric", "efa")
    sock = parse_nccl_log((NCCL / "socket_fallback.log").read_text(), "b.log")
    assert (sock.network, sock.kind, sock.nccl_version) == ("Socket", "socket", "2.7.8")
    assert sock.socket_devices == "[0]lo:127.0.0.1<0> [1]eth0:172.17.0.2<0>"
    assert sock.warnings == ["NET/OFI Only EFA provider is supported"]
    ib = parse_nccl_log("dgx01:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB\ndgx01:1:2 [0] NCCL INFO Using "
                        "network IB\n")
    assert ib.kind == "ib" and ib.ib_devices == "[0]mlx5_0:1/IB"
    assert parse_nccl_log("garbage\n\x00\n").network is None
    # what NCCL 2.28.9 wrote on a machine without IB or EFA (recorded on an H100 for this repository)
    h100 = parse_nccl_log((NCCL / "h100_nccl2289_socket.log").read_text(), "vm.487.log")
    assert (h100.host, h100.network, h100.kind, h100.nccl_version) == ("vm", "Socket", "socket", "2.28.9")
    assert h100.socket_devices == "[0]eth0:192.0.2.2<0>" and h100.warnings == []


def test_judge_warns_on_a_socket_fallback():
    efa = parse_nccl_log((NCCL / "p5en_libfabric.log").read_text(), "a.log")
    sock = parse_nccl_log((NCCL / "socket_fallback.log").read_text(), "b.log")
    warnings, notes = judge([efa, sock], "efa", ranks=2)
    assert len(warnings) == 1 and "1 rank(s) on 005b3f0f299a fell back to TCP sockets" in warnings[0]
    assert "expected EFA through aws-ofi-nccl" in warnings[0] and "fi_info -p efa" in warnings[0]
    assert any("1 rank(s) use Libfabric" in n for n in notes)
    assert any("NET/OFI Only EFA provider is supported" in n for n in notes)
    assert judge([efa], "efa", ranks=1)[0] == []
    # an IB job that got the EFA plugin is not what was expected either
    assert "expected InfiniBand" in judge([efa], "ib")[0][0]
    s = summary([efa, sock])
    assert s["networks"] == {"Libfabric": 1, "Socket": 1} and s["socket_hosts"] == ["005b3f0f299a"]


def test_run_check_waits_for_the_ranks_then_reports(tmp_path):
    d = tmp_path / "nccl"
    d.mkdir()
    shutil.copy(NCCL / "p5en_libfabric.log", d / "8h200-2.6831.log")
    shutil.copy(NCCL / "socket_fallback.log", d / "005b3f0f299a.27.log")
    (d / "half-written.log").write_text("x:1:1 [0] NCCL INFO Bootstrap : Using eth0\n")  # not initialised yet
    out = io.StringIO()
    assert run_check(d, "efa", ranks=3, wait_s=0.3, poll_s=0.1, out=out) == 1
    text = out.getvalue()
    assert "WARNING fabric: 1 rank(s) on 005b3f0f299a fell back to TCP sockets" in text
    assert "2 of 3 rank(s) had initialised NCCL" in text
    out = io.StringIO()
    assert run_check(tmp_path / "missing", "efa", ranks=2, wait_s=0.1, poll_s=0.05, out=out) == 0
    assert "no rank initialised NCCL" in out.getvalue()
    assert len(read_attempt(d)) == 3


def test_job_attempt_fabric_command(tmp_path):
    nccl = tmp_path / "job" / "attempt-2" / "nccl"
    nccl.mkdir(parents=True)
    shutil.copy(NCCL / "socket_fallback.log", nccl / "h.1.log")
    p = subprocess.run([sys.executable, "-m", "gpuguard", "job-attempt", "fabric", "--job-dir", str(tmp_path / "job"),
                        "--attempt", "2", "--expect", "efa", "--ranks", "1", "--wait", "5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "fell back to TCP sockets" in p.stderr
