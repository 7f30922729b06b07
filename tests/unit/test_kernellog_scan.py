"""gpuguard.kernellog's bulk path: the C-level finder, a file split across processes, and `gpuguard xid scan` as an
admin runs it (a whole process: what it imports, what it says, its exit code)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from propbudget import examples

from gpuguard.kernellog import bulk, find, mapped
from gpuguard.kernellog.formats import NEEDLE
from gpuguard.kernellog.scan import scan_xid_bytes

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kernel_log"
REPO = Path(__file__).resolve().parents[2]


def fixture_lines() -> list[str]:
    out = []
    for path in sorted(FIXTURES.glob("*.txt")):
        if path.name == "journal_json.txt":
            continue
        out += [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return out


def mixed_log(repeat: int = 40) -> bytes:
    """Every real fixture line (Xids, forged, malformed, other) between ordinary ones, `repeat` times."""
    lines = []
    for r in range(repeat):
        for i, line in enumerate(fixture_lines()):
            lines.append(f"[{r}.{i:06d}] usb 1-1: ordinary line {r} {i} " + "p" * ((r * 7 + i) % 50))
            lines.append(line)
    return ("\n".join(lines) + "\n").encode()


def summary(r) -> tuple:
    return ([(e.code, e.pci, e.raw) for e in r.events], r.malformed, r.rejected_non_kernel, r.events_dropped,
            r.bytes_scanned)


# --------------------------------------------------------------------------- the finder


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([b"NVRM: Xid", b"NVRM: X", b"id", b"\n", b"x" * 50, b"[78,86,82,77,58,32,88,105,100"]) |
                st.binary(max_size=30), max_size=60), st.booleans())
def test_memmem_finds_exactly_what_bytes_find_finds(pieces, json_lines):
    data = b"".join(pieces)
    with_find = list(find.candidate_lines(data, 0, len(data), json_lines=json_lines))
    old = find.MEMMEM_MIN_BYTES
    find.MEMMEM_MIN_BYTES = 0  # every buffer through libc's memmem
    try:
        with_memmem = list(find.candidate_lines(data, 0, len(data), json_lines=json_lines))
        with_memmem_ba = list(find.candidate_lines(bytearray(data), 0, len(data), json_lines=json_lines))
    finally:
        find.MEMMEM_MIN_BYTES = old
    assert with_memmem == with_find == with_memmem_ba
    for start, end in with_find:  # every span is one whole line holding a needle
        assert b"\n" not in data[start:end] and (start == 0 or data[start - 1:start] == b"\n")


def test_a_needle_across_the_end_of_the_range_is_not_found():
    data = b"ab NVRM: Xid (PCI:0000:3b:00): 79, x\n"
    cut = data.index(NEEDLE) + 4
    old = find.MEMMEM_MIN_BYTES
    find.MEMMEM_MIN_BYTES = 0
    try:
        assert list(find.candidate_lines(data, 0, cut)) == []
        assert list(find.candidate_lines(data, 0, len(data))) == [(0, len(data) - 1)]
    finally:
        find.MEMMEM_MIN_BYTES = old


# --------------------------------------------------------------------------- a file split across processes


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(bulk, "PARALLEL_MIN_BYTES", 4096)


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_parallel_scan_equals_a_single_scan(tmp_path, small_parts, workers):
    data = mixed_log()
    path = tmp_path / "kern.log"
    path.write_bytes(data + b"[9.9] NVRM: Xid (PCI:0000:3b:00): 79, last line without its newline")
    single = bulk.scan_file(str(path), workers=1)
    assert len(single.events) > 100 and single.malformed > 50 and single.rejected_non_kernel > 100
    assert single.events[-1].detail == "last line without its newline"
    assert summary(bulk.scan_file(str(path), workers=workers)) == summary(single)
    assert summary(single)[:3] == summary(scan_xid_bytes(path.read_bytes()))[:3]


def test_parallel_scan_keeps_the_event_cap_of_a_single_scan(tmp_path, small_parts):
    flood = "".join(f"[{i}.0] NVRM: Xid (PCI:0000:3b:00): 13, x{i}\n" for i in range(3000))
    path = tmp_path / "kern.log"
    path.write_text(flood + "[9999.0] NVRM: Xid (PCI:0000:5d:00): 79, the one that matters\n" + flood)
    single = bulk.scan_file(str(path), workers=1, max_events=50)
    split = bulk.scan_file(str(path), workers=4, max_events=50)
    assert summary(split) == summary(single)
    assert len(single.events) == 51 and single.events_dropped == 5950
    assert any(e.code == 79 for e in split.events)


def test_a_failed_child_costs_time_not_results(tmp_path, small_parts, monkeypatch):
    path = tmp_path / "kern.log"
    path.write_bytes(mixed_log(10))
    want = summary(bulk.scan_file(str(path), workers=1))

    def broken(_result):
        raise MemoryError("a child that cannot send its result")

    monkeypatch.setattr(bulk, "_encode", broken)  # only children encode: each one fails
    assert summary(bulk.scan_file(str(path), workers=3)) == want


# --------------------------------------------------------------------------- a part searched where it is mapped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.sampled_from([b"[1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, gone\n", b"NVRM: Xid",
                                 b"Nov 20 10:11:12 node alice: NVRM: Xid (PCI:0000:3b:00): 79, forged\n", b"\n",
                                 b"ordinary line\n", b"x" * 40000, b"\xff\xfe"]) | st.binary(max_size=20),
                max_size=40), st.integers(0, 40))
def test_a_mapped_part_scans_as_a_read_one(tmp_path_factory, pieces, cut):
    """gpuguard.kernellog.mapped gives what the chunked pread scan gives: every Xid line, lines over
    MAX_LINE_BYTES (64 KiB: two or more of the 40 KB pieces) malformed, the last line without its newline."""
    data = b"".join(pieces)
    path = tmp_path_factory.mktemp("mapped") / "kern.log"
    path.write_bytes(data)
    lines = [0] + [i + 1 for i, c in enumerate(data) if c == 0x0A]
    start = lines[min(cut, len(lines) - 1)]  # a part starts at a line start
    fd = os.open(path, os.O_RDONLY)
    try:
        read = bulk._scan_part(fd, start, len(data), 10_000, False)
        mapped_result = mapped.scan_region(fd, start, len(data), 10_000)
    finally:
        os.close(fd)
    assert mapped_result is not None
    assert summary(mapped_result) == summary(read) and mapped_result.end_offset == read.end_offset


def test_a_child_killed_while_reading_its_mapping_costs_time_not_results(tmp_path, small_parts, monkeypatch):
    """A kern.log truncated under a child's mapping (logrotate's copytruncate) ends it with SIGBUS: its part is
    read again here, with pread."""
    path = tmp_path / "kern.log"
    path.write_bytes(mixed_log(10))
    want = summary(bulk.scan_file(str(path), workers=1))

    def sigbus(*_args):
        faulthandler.disable()  # pytest's would print this child's stack
        os.kill(os.getpid(), signal.SIGBUS)

    monkeypatch.setattr(mapped, "scan_region", sigbus)  # only children map
    assert summary(bulk.scan_file(str(path), workers=3)) == want


def test_a_large_file_is_mapped_by_a_child_even_when_not_split(tmp_path, monkeypatch):
    path = tmp_path / "kern.log"
    path.write_bytes(mixed_log(10))
    want = summary(bulk.scan_file(str(path), workers=1))  # workers=1: this process may not fork, pread
    monkeypatch.setattr(bulk, "MAPPED_MIN_BYTES", 4096)
    real = mapped.scan_region

    def watched(*args):
        (tmp_path / f"mapped-by-{os.getpid()}").touch()
        return real(*args)

    monkeypatch.setattr(mapped, "scan_region", watched)
    assert summary(bulk.scan_file(str(path), workers=2)) == want
    mappers = [p.name for p in tmp_path.glob("mapped-by-*")]
    assert len(mappers) == 1 and mappers[0] != f"mapped-by-{os.getpid()}"  # one child mapped it, never this process


def test_parts_never_start_inside_a_line(tmp_path, small_parts):
    """A part that began mid-line could make the tail of a long user-written line look like a kernel message."""
    forged_tail = b"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, forged in the middle of a long line"
    long_line = b"Nov 20 10:11:12 node alice: " + b"y" * (3 << 20) + forged_tail
    data = mixed_log(2) + long_line + b"\n" + mixed_log(2)
    path = tmp_path / "kern.log"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for n in (2, 3, 5):
            bounds = bulk._split(fd, len(data), n)
            assert all(a == 0 or data[a - 1:a] == b"\n" for a, _ in bounds), n
    finally:
        os.close(fd)
    single = bulk.scan_file(str(path), workers=1)
    assert summary(bulk.scan_file(str(path), workers=4)) == summary(single)
    assert all("forged in the middle" not in e.raw for e in single.events)


# --------------------------------------------------------------------------- `gpuguard xid scan`, as a process


def xid_scan(*args: str, input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuguard", "xid", "scan", *args], capture_output=True, text=True,
                          timeout=60, input=input, env={**os.environ, **(env or {})})


def test_xid_scan_loads_only_what_it_needs(tmp_path):
    """No YAML, no config, no runner, no other feature module: start-up is part of the wall time of every scan."""
    log = tmp_path / "kern.log"
    log.write_text("Nov 20 10:11:12 n kernel: [ 1.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, y\n")
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpuguard", "xid", "scan", "--file", str(log)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "gpuguard.cli.xidscan" in imported and "gpuguard.checks.xid" in imported
    for heavy in ("yaml", "gpuguard.config.schema", "gpuguard.runner", "gpuguard.store.sqlite", "gpuguard.watch.daemon", "pickle",
                  "gpuguard.kernellog.sources", "subprocess", "ctypes"):
        assert heavy not in imported, heavy


def test_xid_scan_of_journal_json_finds_a_message_printed_as_bytes(tmp_path):
    lines = [ln for ln in (FIXTURES / "journal_json.txt").read_text().splitlines() if ln.startswith("{")]
    log = tmp_path / "journal.json"
    log.write_text("\n".join(lines) + "\n")
    out = json.loads(xid_scan("--file", str(log), "--json").stdout)
    want = [(79, "0000:44:00"), (13, "0000:43:00"), (79, "0000:44:00")]
    assert [(e["code"], e["pci"]) for e in out["events"]] == want
    assert out["events"][2]["process"] == "p\ufffdy"  # its MESSAGE is an array of byte values
    assert out["rejected_non_kernel"] == 2


def test_xid_scan_applies_the_sites_overrides_and_policy(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("Nov 20 10:11:12 n kernel: [ 1.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics\n")
    assert xid_scan("--file", str(log)).returncode == 0  # Xid 13: the application's fault, no drain
    cfg = tmp_path / "c.yaml"
    cfg.write_text("xid: {overrides: {13: {severity: fatal}}}\n")
    p = xid_scan("--file", str(log), "--config", str(cfg))
    assert p.returncode == 1 and "Xid  13 FATAL" in p.stdout and "[scan]" in p.stdout
    cfg.write_text("xid: {overrides: {13: {severity: fatal}}}\npolicy: {on_failure: report}\n")
    out = json.loads(xid_scan("--file", str(log), "--config", str(cfg), "--json").stdout)
    assert out["verdict"]["outcome"] == "warn" and out["events"][0]["fatal"]
    cfg.write_text("xid: {overrides: {13: {severity: sometimes}}}\n")
    p = xid_scan("--file", str(log), "--config", str(cfg))
    assert p.returncode == 2 and "severity" in p.stderr and "Traceback" not in p.stderr


def test_xid_scan_text_names_the_verdict_and_the_size(tmp_path):
    log = tmp_path / "kern.log"
    log.write_bytes(mixed_log(3))
    p = xid_scan("--file", str(log))
    assert p.returncode == 1, p.stderr
    last = p.stdout.splitlines()[-1]
    assert last.startswith("verdict: drain (gpuguard: XID") and last.endswith("])")
    assert " KiB; " in p.stdout and "not from the kernel" in p.stdout
    p = xid_scan("--file", "-", input="nothing to see\n")
    assert p.returncode == 0 and "0 Xid events (0 fatal) in 15 bytes" in p.stdout and "verdict: pass" in p.stdout
