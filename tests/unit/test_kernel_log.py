"""The kernel-log package (gpuguard.kernellog): line formats, forged-line rejection, fast scanning, sources, cursors.

Real-world lines live in tests/fixtures/kernel_log/*.txt, each block with its source; a `#=` line before a log
line gives its expected parse (see the README there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from propbudget import examples

from gpuguard.kernellog import formats
from gpuguard.kernellog.base import kmsg_readable
from gpuguard.kernellog.dmesg import DmesgSource
from gpuguard.kernellog.file import FileSource
from gpuguard.kernellog.formats import (MAX_LINE_BYTES, NEEDLE, Verdict, parse_kernel_log_line, parse_xid_line,
                                        parse_xid_message)
from gpuguard.kernellog.journal import JournalSource
from gpuguard.kernellog.kmsg import KmsgSource
from gpuguard.kernellog.scan import observation, scan_text_for_xids, scan_xid_bytes, scan_xid_file
from gpuguard.kernellog.sources import make_follower, make_source, read_xid_events
from gpuguard.model import KernelLogObservation, XidEvent

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kernel_log"
BOOT_A = "11111111-2222-3333-4444-555555555555"
BOOT_B = "99999999-8888-7777-6666-555555555555"


# --------------------------------------------------------------------------- fixture loading


@dataclasses.dataclass
class Case:
    file: str
    lineno: int
    line: str
    verdict: str
    expect: dict[str, str]


def _parse_expect(text: str) -> tuple[str, dict[str, str]]:
    body = text[len("#="):].strip()
    detail = None
    if " detail=" in f" {body}":
        body, _, detail = f" {body}".partition(" detail=")
        body = body.strip()
    verdict, *pairs = body.split(" ")
    expect: dict[str, str] = {}
    # values may contain spaces (ts=Fri Aug 30 11:43:09 2024): a token without '=' continues the last value
    last = None
    for tok in pairs:
        if "=" in tok and tok.split("=", 1)[0] in {"code", "pci", "pid", "name", "fmt", "seq", "mono", "ts"}:
            last, value = tok.split("=", 1)
            expect[last] = value
        elif last is not None:
            expect[last] += " " + tok
    if detail is not None:
        expect["detail"] = detail
    return verdict, expect


def load_cases(name: str) -> list[Case]:
    cases = []
    pending: Optional[tuple[str, dict[str, str]]] = None
    for i, line in enumerate((FIXTURES / name).read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#="):
            pending = _parse_expect(line)
            continue
        if line.startswith("#") or not line.strip():
            continue
        verdict, expect = pending or (Verdict.OTHER, {})
        cases.append(Case(name, i, line, verdict, expect))
        pending = None
    return cases


def log_lines(name: str) -> list[str]:
    return [c.line for c in load_cases(name)]


FIXTURE_FILES = sorted(p.name for p in FIXTURES.glob("*.txt"))
ALL_CASES = [c for f in FIXTURE_FILES for c in load_cases(f)]


def _check_event(event: XidEvent, expect: dict[str, str]) -> None:
    def want(key: str) -> Optional[str]:
        v = expect[key]
        return None if v == "None" else v

    if "code" in expect:
        assert event.code == int(expect["code"])
    if "pci" in expect:
        assert event.pci == expect["pci"]
    if "pid" in expect:
        assert event.pid == (None if want("pid") is None else int(expect["pid"]))
    if "name" in expect:
        assert event.process_name == want("name")
    if "seq" in expect:
        assert event.seq == int(expect["seq"])
    if "mono" in expect:
        assert event.monotonic_s == pytest.approx(float(expect["mono"]))
    if "ts" in expect:
        assert event.timestamp == want("ts")
    if "detail" in expect:
        assert event.detail == expect["detail"]


# --------------------------------------------------------------------------- every format, real lines


def test_fixtures_cover_every_format_and_xid_of_interest():
    assert len(FIXTURE_FILES) >= 7
    fmts = {parse_kernel_log_line(c.line).fmt for c in ALL_CASES if c.verdict != Verdict.OTHER}
    for fmt in ["kmsg", "dmesg", "dmesg-ctime", "dmesg-raw", "dmesg-decoded", "syslog", "syslog-iso",
                "journal-json", "journal-full", "journal-unix", "bare"]:
        assert fmt in fmts, fmt
    codes = {c.expect.get("code") for c in ALL_CASES if c.verdict == Verdict.XID}
    for code in ["13", "48", "63", "64", "74", "79", "94", "95", "119", "154"]:
        assert code in codes, code


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: f"{c.file}:{c.lineno}")
def test_fixture_line(case: Case):
    res = parse_kernel_log_line(case.line)
    assert res.verdict == case.verdict, res.reason
    if "fmt" in case.expect:
        assert res.fmt == case.expect["fmt"]
    if case.verdict == Verdict.XID:
        assert res.event is not None
        assert res.event.raw == case.line
        _check_event(res.event, case.expect)
    else:
        assert res.event is None
    if "seq" in case.expect:
        assert res.seq == int(case.expect["seq"])


@pytest.mark.parametrize("name", [f for f in FIXTURE_FILES if f != "journal_json.txt"])
def test_scanner_agrees_with_line_parser_on_fixture_files(name: str):
    cases = load_cases(name)
    data = "".join(c.line + "\n" for c in cases).encode()
    result = scan_xid_bytes(data)
    assert result.lines_scanned == len(cases)
    assert [e.raw for e in result.events] == [c.line for c in cases if c.verdict == Verdict.XID]
    assert result.malformed == sum(c.verdict == Verdict.MALFORMED for c in cases)
    assert result.rejected_non_kernel == sum(c.verdict == Verdict.NON_KERNEL for c in cases)


# --------------------------------------------------------------------------- the Xid message itself


@pytest.mark.parametrize(
    "message, code, pci, pid, name, detail",
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
         79, "0000:3b:00", 1234, "python", "GPU has fallen off the bus."),
        ("NVRM: Xid (0000:3b:00): 79, GPU has fallen off the bus.", 79, "0000:3b:00", None, None,
         "GPU has fallen off the bus."),
        ("NVRM: Xid (PCI:0000:3B:00.0): 48, pid='<unknown>', name=<unknown>, DBE", 48, "0000:3b:00", None, None, "DBE"),
        ("NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, pid=9, name=a, Graphics Exception",
         13, "0000:3b:00", 9, "a", "Graphics Exception"),
        ("NVRM: Xid (PCI:0000:17:00): 119, pid=5678, name=nvc:[driver], Timeout waiting for RPC from GSP",
         119, "0000:17:00", 5678, "nvc:[driver]", "Timeout waiting for RPC from GSP"),
        ("NVRM: Xid (PCI:0000:01:00): 38, pid=1659,", 38, "0000:01:00", 1659, None, ""),
        ("NVRM: Xid (PCI:0009:01:00): 74, pid=1", 74, "0009:01:00", 1, None, ""),
        ("NVRM: Xid (0000:01:00): 16, ", 16, "0000:01:00", None, None, ""),
        ("NVRM: Xid (PCI:0000:01:00): 79", 79, "0000:01:00", None, None, ""),
        ("NVRM: Xid (PCI:10000:01:00): 79, pid=<n/a>, name=<unknown>, x", 79, "10000:01:00", None, None, "x"),
    ],
)
def test_parse_xid_message_variants(message, code, pci, pid, name, detail):
    ev = parse_xid_message(message, timestamp="t", monotonic_s=1.5, seq=7)
    assert ev is not None
    assert (ev.code, ev.pci, ev.pid, ev.process_name, ev.detail) == (code, pci, pid, name, detail)
    assert (ev.timestamp, ev.monotonic_s, ev.seq, ev.raw) == ("t", 1.5, 7, message.rstrip())


@pytest.mark.parametrize(
    "message",
    [
        "NVRM: Xid (PCI:0000:3b:00): abc",
        "NVRM: Xid (PCI:0000:3b:00): 79abc",
        "NVRM: Xid (PCI:...): 145, RLW",
        "NVRM: Xid 119, no device",
        "NVRM: Xid (PCI:0000:3b): 79, short address",
        "NVRM: GPU 0000:3b:00.0: RmInitAdapter failed!",
        "",
    ],
)
def test_parse_xid_message_rejects_malformed(message):
    assert parse_xid_message(message) is None


def test_parse_xid_line_is_the_event_or_none():
    assert parse_xid_line("[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, x").code == 79
    assert parse_xid_line("Nov 20 10:11:12 h alice: NVRM: Xid (PCI:0000:3b:00): 79, x") is None
    assert parse_xid_line("[ 1.0] NVRM: Xid (PCI:0000:3b:00): x") is None
    assert parse_xid_line("[ 1.0] usb 1-1: new device") is None


def test_caller_id_prefix_is_accepted():
    for line in ["[ 12.345678] [T1234] NVRM: Xid (PCI:0000:3b:00): 79, x",
                 "Nov 20 10:11:12 h kernel: [ 12.345678] [  C3] NVRM: Xid (PCI:0000:3b:00): 79, x"]:
        assert parse_kernel_log_line(line).verdict == Verdict.XID, line


def test_detail_and_raw_are_capped():
    line = "[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, " + "y" * 20000
    ev = parse_xid_line(line)
    assert ev is not None and len(ev.detail) < 5000 and len(ev.raw) < 5000


# --------------------------------------------------------------------------- forged lines, per format


@pytest.mark.parametrize(
    "line",
    [
        # /dev/kmsg: facility 1 (user), as the kernel records every userspace write
        "12,344,1605807770,-;NVRM: Xid (PCI:0000:3b:00): 79, x",
        "8,343,1605805890,-;NVRM: Xid (PCI:0000:3b:00): 79, x",
        "30,1,1,-;NVRM: Xid (PCI:0000:3b:00): 79, x",
        # journal JSON: logger's syslog transport, stdout of a service, or a kmsg write with a user facility
        json.dumps({"_TRANSPORT": "syslog", "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, x"}),
        json.dumps({"_TRANSPORT": "stdout", "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, x"}),
        json.dumps({"_TRANSPORT": "journal", "SYSLOG_IDENTIFIER": "kernel", "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, x"}),
        json.dumps({"_TRANSPORT": "kernel", "SYSLOG_FACILITY": "1", "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, x"}),
        json.dumps({"MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, x"}),
        # syslog / journal text: any tag but `kernel`
        "Nov 20 10:11:12 node1 user: NVRM: Xid (PCI:0000:3b:00): 79, x",
        "Nov 20 10:11:12 node1 logger: NVRM: Xid (PCI:0000:3b:00): 79, x",
        "Nov 20 10:11:12 node1 kernel-x: NVRM: Xid (PCI:0000:3b:00): 79, x",
        "Nov 20 10:11:12 node1 Kernel: NVRM: Xid (PCI:0000:3b:00): 79, x",
        "2023-11-20T10:11:12.123456+00:00 node1 bob[77]: NVRM: Xid (PCI:0000:3b:00): 79, x",
        "2023-11-20T10:11:12+0000 node1 NVRM: Xid (PCI:0000:3b:00): 79, x",
        "Mon 2023-11-20 10:11:12 UTC node1 root: NVRM: Xid (PCI:0000:3b:00): 79, x",
        "[ 1234.567890] node1 user: NVRM: Xid (PCI:0000:3b:00): 79, x",
        "user: NVRM: Xid (PCI:0000:3b:00): 79, x",
        # dmesg with the facility visible
        "user  :warn  : [ 1605.807770] NVRM: Xid (PCI:0000:3b:00): 79, x",
        "<14>[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, x",
        "10.0.0.1: user: warning: [2026-04-22T21:27:51.2Z]: NVRM: Xid (PCI:0000:3b:00): 79, x",
    ],
)
def test_forged_lines_are_rejected(line):
    res = parse_kernel_log_line(line)
    assert res.verdict == Verdict.NON_KERNEL, res
    obs = scan_text_for_xids(line + "\n")
    assert obs.events == [] and obs.rejected_non_kernel == 1


def test_kernel_tag_in_syslog_is_trusted_documented_limitation():
    # `logger -t kernel` produces exactly this in a syslog file; only kernel-only sources avoid it
    assert parse_kernel_log_line("Nov 20 10:11:12 node1 kernel: NVRM: Xid (PCI:0000:3b:00): 79, x").verdict == Verdict.XID
    assert "logger -t kernel" in (formats.__doc__ or "")


# --------------------------------------------------------------------------- hostile content


def test_hostile_bytes_never_crash():
    data = b"".join([
        b"\x00\x00NVRM: Xid (PCI:0000:3b:00): 79, \xff\xfe bad utf8\n",
        b"[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=\xc3\x28, x\x00y\n",
        b"NVRM: Xid" * 10000 + b"\n",
        b"X" * 3_000_000 + b"\n",
        b"\n\n\r\n",
        b"{" * 5000 + b"NVRM: Xid\n",
        b"{\"MESSAGE\": [" + b"1," * 100 + b"999], \"x\": \"NVRM: Xid\"}\n",
        b"4,1,1,-;" + b"NVRM: Xid (PCI:0000:3b:00): 79, " + b"\xff" * 100,
    ])
    r = scan_xid_bytes(data)
    assert r.lines_scanned == 10
    # invalid UTF-8 becomes U+FFFD and the lines still parse; NULs stay as they are
    assert [e.code for e in r.events] == [79, 79]
    assert r.events[0].process_name == "\ufffd(" and r.events[0].detail == "x\x00y"
    assert r.events[1].detail == "\ufffd" * 100
    assert r.malformed == 3  # overlong needle line, '{{{' JSON, bad MESSAGE array
    assert r.rejected_non_kernel == 1  # NULs before "NVRM:" make it no kernel message at all


def test_overlong_line_with_needle_is_malformed_not_parsed():
    line = b"[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, " + b"z" * (MAX_LINE_BYTES + 10)
    data = b"ok line\n" + line + b"\n[ 2.0] NVRM: Xid (PCI:0000:3b:00): 48, y\n"
    for chunk in (None, 7, 1000, 1 << 20):
        r = scan_xid_bytes(data, chunk_size=chunk)
        assert (r.lines_scanned, r.malformed, [e.code for e in r.events]) == (3, 1, [48]), chunk


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4000))
def test_arbitrary_bytes_never_raise(data: bytes):
    r = scan_xid_bytes(data)
    assert r.lines_scanned == data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    for line in data.split(b"\n")[:50]:
        parse_kernel_log_line(line.decode("utf-8", errors="replace"))


_PIECES = [line.encode() for line in (
    log_lines("dmesg.txt") + log_lines("syslog.txt") + log_lines("kmsg.txt") + log_lines("forged.txt")
    + log_lines("malformed.txt") + log_lines("journal_json.txt")[:3]
)] + [b"\n", b"NVRM: Xid", b"X", b"\xff\x00", b"    ", b"NVRM: X", b"id (PCI:0000:3b:00): 79, x\n"]


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_PIECES) | st.binary(max_size=40), max_size=40),
       st.integers(min_value=1, max_value=300), st.booleans())
def test_chunked_scan_equals_whole_scan(pieces: list[bytes], chunk: int, final: bool):
    data = b"\n".join(pieces)
    whole = scan_xid_bytes(data, final=final)
    chunked = scan_xid_bytes(data, final=final, chunk_size=chunk)
    assert chunked.events == whole.events
    assert (chunked.lines_scanned, chunked.malformed, chunked.rejected_non_kernel, chunked.end_offset) == (
        whole.lines_scanned, whole.malformed, whole.rejected_non_kernel, whole.end_offset)
    # the line-by-line reference
    lines = data.split(b"\n")
    complete = lines[:-1] + ([lines[-1]] if final and lines[-1] else [])
    verdicts = [parse_kernel_log_line(x.decode("utf-8", errors="replace")) for x in complete
                if NEEDLE in x and len(x) <= MAX_LINE_BYTES]
    assert [v.event for v in verdicts if v.event] == whole.events


# --------------------------------------------------------------------------- chunk boundaries


def _mixed_log() -> bytes:
    lines = []
    for i, c in enumerate(ALL_CASES):
        if c.file != "journal_json.txt":
            lines.append(c.line)
        lines.append(f"[{i}.000001] usb 1-1: ordinary line number {i} " + "p" * (i % 37))
    return ("\n".join(lines) + "\n").encode()


def test_every_chunk_size_gives_the_same_result(tmp_path):
    data = _mixed_log()
    ref = scan_xid_bytes(data)
    assert len(ref.events) > 40 and ref.malformed > 5 and ref.rejected_non_kernel > 10
    path = tmp_path / "kern.log"
    path.write_bytes(data)
    for chunk in list(range(1, 64)) + [100, 255, 256, 257, 4096, len(data) - 1, len(data), len(data) + 1]:
        got = scan_xid_file(str(path), chunk_size=chunk)
        assert got.events == ref.events, chunk
        assert (got.lines_scanned, got.malformed, got.rejected_non_kernel) == (
            ref.lines_scanned, ref.malformed, ref.rejected_non_kernel), chunk
        assert got.end_offset == len(data)


def test_partial_last_line_is_left_for_next_time(tmp_path):
    path = tmp_path / "kern.log"
    head = b"[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, a\n"
    path.write_bytes(head + b"[ 2.0] NVRM: Xid (PCI:0000:3b:00): 4")
    r = scan_xid_file(str(path), chunk_size=5)
    assert [e.code for e in r.events] == [79] and r.end_offset == len(head) and r.lines_scanned == 1
    r = scan_xid_file(str(path), chunk_size=5, final=True)
    assert [e.code for e in r.events] == [79, 4] and r.end_offset == path.stat().st_size


def test_needle_split_across_many_reads():
    data = b"aaa\n" * 3 + b"[ 9.5] NVRM: Xid (PCI:0000:3b:00): 95, pid=1, name=n, Uncontained\n" + b"bbb\n"
    for chunk in range(1, 20):
        r = scan_xid_bytes(data, chunk_size=chunk)
        assert [(e.code, e.monotonic_s) for e in r.events] == [(95, 9.5)], chunk


def test_anchor_falls_back_when_anchor_bytes_are_dense():
    # a log full of 'X' (and of every other needle byte) must still find the one real Xid
    noise = (b"XXXX VVVV RRRR MMMM NNNN iiii dddd XFS EXT4 UNIX\n" * 200_000)
    data = noise + b"[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, x\n" + noise
    r = scan_xid_bytes(data)
    assert [e.code for e in r.events] == [79] and r.lines_scanned == 400_001


def test_events_are_capped_but_every_code_and_gpu_kept():
    lines = [f"[ {i}.0] NVRM: Xid (PCI:0000:3b:00): 13, x{i}" for i in range(50)]
    lines.append("[ 99.0] NVRM: Xid (PCI:0000:3b:00): 79, fell off")
    lines.append("[ 99.5] NVRM: Xid (PCI:0000:5d:00): 13, other gpu")
    r = scan_xid_bytes(("\n".join(lines) + "\n").encode(), max_events=10)
    assert len(r.events) == 12 and r.events_dropped == 40
    assert {(e.code, e.pci) for e in r.events} == {(13, "0000:3b:00"), (79, "0000:3b:00"), (13, "0000:5d:00")}
    obs = observation(r, "x", None)
    assert obs.status.complete and "40" in (obs.status.error or "")


# --------------------------------------------------------------------------- scan_text_for_xids (CLI helper)


def test_scan_text_for_xids_mixed_formats_and_json_output():
    text = "\n".join(log_lines("syslog.txt") + log_lines("dmesg.txt") + log_lines("forged.txt"))
    obs = scan_text_for_xids(text)
    assert isinstance(obs, KernelLogObservation) and obs.status.complete and obs.cursor is None
    assert obs.rejected_non_kernel == 8
    assert len(obs.events) > 20
    out = json.dumps({"events": [dataclasses.asdict(e) for e in obs.events]})
    first = json.loads(out)["events"][0]
    assert isinstance(first["code"], int) and first["pci"] == "0000:41:00"
    assert scan_text_for_xids(text.encode()).events == obs.events
    assert scan_text_for_xids("") .events == []


# --------------------------------------------------------------------------- FileSource cursor


def _xid(i: int, code: int = 79) -> str:
    return f"Nov 20 10:11:{i % 60:02d} node1 kernel: [{1000 + i}.000000] NVRM: Xid (PCI:0000:3b:00): {code}, n{i}\n"


def test_file_cursor_only_new_lines_after_append(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text("".join(_xid(i) for i in range(3)) + "Nov 20 10:11:12 node1 kernel: ordinary\n")
    obs = read_xid_events(f"file:{path}", None, timeout_s=5)
    assert obs.status.complete and [e.detail for e in obs.events] == ["n0", "n1", "n2"]
    assert obs.lines_scanned == 4 and obs.source == f"file:{path}"
    cursor = obs.cursor
    assert cursor["kind"] == "file" and cursor["offset"] == path.stat().st_size
    assert json.loads(json.dumps(cursor)) == cursor

    again = read_xid_events(f"file:{path}", cursor, timeout_s=5)
    assert again.events == [] and again.lines_scanned == 0 and again.cursor == cursor

    with open(path, "a") as f:
        f.write(_xid(3) + _xid(4, code=48))
    new = read_xid_events(f"file:{path}", cursor, timeout_s=5)
    assert [(e.code, e.detail) for e in new.events] == [(79, "n3"), (48, "n4")] and new.lines_scanned == 2


def test_file_cursor_waits_for_the_rest_of_a_partial_line(tmp_path):
    path = tmp_path / "kern.log"
    full = _xid(0)
    path.write_text(full[:30])
    obs = read_xid_events(f"file:{path}", None, timeout_s=5)
    assert obs.events == [] and obs.cursor["offset"] == 0
    with open(path, "a") as f:
        f.write(full[30:])
    obs = read_xid_events(f"file:{path}", obs.cursor, timeout_s=5)
    assert [e.detail for e in obs.events] == ["n0"]


def test_file_growing_past_head_size_is_not_truncation(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(_xid(0))  # < 256 bytes: the head covers less than 256 bytes
    c = read_xid_events(f"file:{path}", None, timeout_s=5).cursor
    assert c["head_len"] == path.stat().st_size < 256
    with open(path, "a") as f:
        f.write(_xid(1) * 5)
    obs = read_xid_events(f"file:{path}", c, timeout_s=5)
    assert len(obs.events) == 5


def test_file_rotation_reads_new_file_from_start(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(_xid(0) + _xid(1))
    c = read_xid_events(f"file:{path}", None, timeout_s=5).cursor
    os.rename(path, tmp_path / "kern.log.1")
    path.write_text(_xid(0) + _xid(1) + _xid(2))  # same first bytes, bigger: only the inode tells
    assert path.stat().st_ino != c["inode"]
    obs = read_xid_events(f"file:{path}", c, timeout_s=5)
    assert [e.detail for e in obs.events] == ["n0", "n1", "n2"]


def test_file_truncation_reads_from_start(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(_xid(0) + _xid(1) + _xid(2))
    c = read_xid_events(f"file:{path}", None, timeout_s=5).cursor
    with open(path, "w") as f:  # same inode, smaller (logrotate copytruncate)
        f.write(_xid(7))
    obs = read_xid_events(f"file:{path}", c, timeout_s=5)
    assert [e.detail for e in obs.events] == ["n7"]


def test_file_rewritten_in_place_with_different_head_reads_from_start(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(_xid(0) + _xid(1))
    c = read_xid_events(f"file:{path}", None, timeout_s=5).cursor
    with open(path, "r+") as f:  # same inode, bigger than the offset, but different content
        f.write(_xid(30) + _xid(31) + _xid(32))
    obs = read_xid_events(f"file:{path}", c, timeout_s=5)
    assert [e.detail for e in obs.events] == ["n30", "n31", "n32"]


def test_unchanged_1gib_file_rescan_is_fast(tmp_path):
    path = tmp_path / "big.log"
    with open(path, "wb") as f:  # sparse: 1 GiB without using the disk
        f.truncate(1 << 30)
    import hashlib

    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(256)).hexdigest()[:32]
    cursor = {"kind": "file", "path": str(path), "inode": path.stat().st_ino, "offset": 1 << 30,
              "head": head, "head_len": 256}
    t0 = time.perf_counter()
    obs = read_xid_events(f"file:{path}", cursor, timeout_s=5)
    elapsed = time.perf_counter() - t0
    assert obs.status.complete and obs.events == [] and obs.cursor == cursor
    assert elapsed < 0.05, elapsed


def test_foreign_or_garbage_cursor_means_start(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(_xid(0))
    for cursor in [{"kind": "kmsg", "seq": 5}, {"kind": "file"}, {"kind": "file", "path": str(path),
                   "inode": "x", "offset": -3}, {}, None]:
        obs = read_xid_events(f"file:{path}", cursor, timeout_s=5)
        assert len(obs.events) == 1, cursor


def test_file_source_timeout_gives_incomplete(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(_xid(0) * 1000)
    obs = FileSource(str(path), chunk_size=64).read(None, timeout_s=0)
    assert not obs.status.complete and obs.status.timed_out
    assert obs.cursor["offset"] == 0  # nothing consumed: the next run reads it all


def test_missing_file_is_incomplete_not_raised(tmp_path):
    cursor = {"kind": "file", "path": "x", "inode": 1, "offset": 0, "head": "", "head_len": 0}
    obs = read_xid_events(f"file:{tmp_path / 'nope.log'}", cursor, timeout_s=5)
    assert not obs.status.complete and "FileNotFoundError" in obs.status.error
    assert obs.cursor == cursor and obs.status.duration_s >= 0


# --------------------------------------------------------------------------- KmsgSource


def _kmsg(seq: int, msg: str, pri: int = 3) -> str:
    return f"{pri},{seq},{seq * 1000},-;{msg}\n"


def _kmsg_file(path: Path, first: int, last: int, xid_every: int = 3) -> None:
    with open(path, "w") as f:
        for s in range(first, last + 1):
            if s % xid_every == 0:
                f.write(_kmsg(s, f"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=p, seq{s}"))
                f.write(" SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n")
            else:
                f.write(_kmsg(s, f"ordinary {s}", pri=6))
        f.write(_kmsg(last + 1, "NVRM: Xid (PCI:0000:3b:00): 79, forged by a user", pri=12))


def _kmsg_keys(cursor: dict) -> dict:
    return {k: cursor[k] for k in ("kind", "boot_id", "seq")}


def test_kmsg_file_cursor_by_seq_and_boot_id(tmp_path):
    path = tmp_path / "kmsg"
    _kmsg_file(path, 0, 20)
    obs = read_xid_events(f"kmsg:{path}", None, timeout_s=5, boot_id=BOOT_A)
    assert obs.status.complete
    assert [e.seq for e in obs.events] == [0, 3, 6, 9, 12, 15, 18]
    assert obs.rejected_non_kernel == 1
    assert obs.events[1].monotonic_s == pytest.approx(0.003) and obs.events[1].timestamp == "0.003000"
    assert _kmsg_keys(obs.cursor) == {"kind": "kmsg", "boot_id": BOOT_A, "seq": 21}
    assert obs.cursor["offset"] == path.stat().st_size  # a file of records also resumes by position

    same = read_xid_events(f"kmsg:{path}", obs.cursor, timeout_s=5, boot_id=BOOT_A)
    assert same.events == [] and same.rejected_non_kernel == 0 and same.cursor == obs.cursor

    _kmsg_file(path, 0, 30)  # more records (the forged one at 21 is now an ordinary one)
    more = read_xid_events(f"kmsg:{path}", obs.cursor, timeout_s=5, boot_id=BOOT_A)
    assert [e.seq for e in more.events] == [24, 27, 30] and more.cursor["seq"] == 31

    rebooted = read_xid_events(f"kmsg:{path}", more.cursor, timeout_s=5, boot_id=BOOT_B)
    assert len(rebooted.events) == 11 and rebooted.cursor["boot_id"] == BOOT_B


def test_kmsg_boot_id_read_from_path(tmp_path):
    path = tmp_path / "kmsg"
    _kmsg_file(path, 0, 5)
    boot = tmp_path / "boot_id"
    boot.write_text(BOOT_A + "\n")
    obs = read_xid_events(f"kmsg:{path}", None, timeout_s=5, boot_id_path=str(boot))
    assert obs.cursor["boot_id"] == BOOT_A
    boot.write_text(BOOT_B + "\n")
    obs2 = read_xid_events(f"kmsg:{path}", obs.cursor, timeout_s=5, boot_id_path=str(boot))
    assert len(obs2.events) == len(obs.events) == 2


def test_kmsg_sequence_restart_without_boot_id_reads_all(tmp_path):
    path = tmp_path / "kmsg"
    _kmsg_file(path, 0, 30)
    c = read_xid_events(f"kmsg:{path}", None, timeout_s=5, boot_id_path=str(tmp_path / "none")).cursor
    assert c["boot_id"] is None and c["seq"] == 31
    _kmsg_file(path, 0, 8)  # the numbering started again: a reboot nobody told us about
    obs = read_xid_events(f"kmsg:{path}", c, timeout_s=5, boot_id_path=str(tmp_path / "none"))
    assert [e.seq for e in obs.events] == [0, 3, 6]


def test_kmsg_records_lost_from_ring_buffer_is_incomplete(tmp_path):
    path = tmp_path / "kmsg"
    _kmsg_file(path, 0, 10)
    c = read_xid_events(f"kmsg:{path}", None, timeout_s=5, boot_id=BOOT_A).cursor
    _kmsg_file(path, 40, 60)  # 12..39 were overwritten before we looked again
    obs = read_xid_events(f"kmsg:{path}", c, timeout_s=5, boot_id=BOOT_A)
    assert not obs.status.complete and "12..39" in obs.status.error
    assert [e.seq for e in obs.events] == [42, 45, 48, 51, 54, 57, 60]


@pytest.mark.skipif(not kmsg_readable("/dev/kmsg"), reason="/dev/kmsg not readable here")
def test_real_dev_kmsg_reads_and_resumes():
    obs = read_xid_events("kmsg", None, timeout_s=10)
    assert obs.status.complete, obs.status.error
    assert obs.lines_scanned > 0 and isinstance(obs.cursor["seq"], int)
    again = read_xid_events("kmsg", obs.cursor, timeout_s=10)
    assert again.status.complete and again.lines_scanned < obs.lines_scanned
    assert again.cursor["seq"] >= obs.cursor["seq"]
    assert all(e.seq > obs.cursor["seq"] for e in again.events)


# --------------------------------------------------------------------------- stub tools


def _stub(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def _printing_stub(tmp_path: Path, name: str, output: str, rc: int = 0) -> tuple[str, Path]:
    out = tmp_path / f"{name}.out"
    out.write_text(output)
    args = tmp_path / f"{name}.args"
    return _stub(tmp_path, name, f'printf "%s\\n" "$@" >> "{args}"\ncat "{out}"\nexit {rc}\n'), args


JOURNAL_OUT = "\n".join(log_lines("journal_json.txt")) + "\n"


def test_journal_source_parses_and_returns_last_cursor(tmp_path):
    journalctl, args = _printing_stub(tmp_path, "journalctl", JOURNAL_OUT)
    obs = read_xid_events(f"journal:{journalctl}", None, timeout_s=10, boot_id=BOOT_A)
    assert obs.status.complete, obs.status.error
    assert [(e.code, e.pci) for e in obs.events] == [(79, "0000:44:00"), (13, "0000:43:00"), (79, "0000:44:00")]
    assert obs.events[2].process_name == "p\ufffdy"  # MESSAGE printed as a byte array
    assert obs.rejected_non_kernel == 2 and obs.lines_scanned == 6
    assert obs.cursor == {"kind": "journal", "cursor": "s=6f1d;i=1a30;b=2c5e;m=6de0b4f6;t=6410a0e6d1f45;x=6",
                          "boot_id": BOOT_A}
    argv = args.read_text().split("\n")
    assert argv[:4] == ["-k", "-o", "json", "--no-pager"] and "-b" in argv
    assert not any(a.startswith("--after-cursor") for a in argv)

    args.unlink()
    read_xid_events(f"journal:{journalctl}", obs.cursor, timeout_s=10, boot_id=BOOT_A)
    argv = args.read_text().split("\n")
    assert f"--after-cursor={obs.cursor['cursor']}" in argv


def test_journal_cursor_from_other_boot_is_dropped(tmp_path):
    journalctl, args = _printing_stub(tmp_path, "journalctl", "")
    cursor = {"kind": "journal", "cursor": "s=1;i=2", "boot_id": BOOT_B}
    obs = read_xid_events(f"journal:{journalctl}", cursor, timeout_s=10, boot_id=BOOT_A)
    assert obs.status.complete and obs.events == []
    assert "-b" in args.read_text().split("\n")
    assert obs.cursor == {"kind": "journal", "cursor": None, "boot_id": BOOT_A}


def test_journal_bad_cursor_falls_back_to_whole_boot(tmp_path):
    # a stub that fails when given a cursor, like journalctl after the journal was vacuumed
    out = tmp_path / "j.out"
    out.write_text(JOURNAL_OUT)
    journalctl = _stub(tmp_path, "journalctl", f"""
for a in "$@"; do case "$a" in --after-cursor=*) echo "Failed to seek to cursor: Invalid argument" >&2; exit 1;; esac; done
cat "{out}"
""")
    obs = read_xid_events(f"journal:{journalctl}", {"kind": "journal", "cursor": "bogus", "boot_id": BOOT_A},
                          timeout_s=10, boot_id=BOOT_A)
    assert obs.status.complete and len(obs.events) == 3


def test_journal_failure_is_incomplete(tmp_path):
    journalctl = _stub(tmp_path, "journalctl", "echo 'No journal files were opened due to insufficient permissions.' >&2\nexit 1\n")
    obs = read_xid_events(f"journal:{journalctl}", None, timeout_s=10, boot_id=BOOT_A)
    assert not obs.status.complete and "insufficient permissions" in obs.status.error
    obs = read_xid_events(f"journal:{tmp_path / 'missing'}", {"kind": "journal", "cursor": "c"}, timeout_s=10)
    assert not obs.status.complete and obs.cursor == {"kind": "journal", "cursor": "c"}


@pytest.mark.parametrize("tool", ["journal", "dmesg"])
def test_tool_that_hangs_is_killed_at_timeout(tmp_path, tool):
    # the stub's child keeps the pipes open too: only killing the whole process group ends it
    pidfile = tmp_path / "child.pid"
    stub = _stub(tmp_path, "hang", f"sleep 1000 &\necho $! > {pidfile}\nwait\n")
    t0 = time.monotonic()
    obs = read_xid_events(f"{tool}:{stub}", {"kind": tool, "x": 1}, timeout_s=0.5, boot_id=BOOT_A)
    elapsed = time.monotonic() - t0
    assert elapsed < 4, elapsed
    assert not obs.status.complete and obs.status.timed_out and "timed out" in obs.status.error
    assert obs.events == []
    child = int(pidfile.read_text())
    time.sleep(0.1)
    assert _gone_or_zombie(child)


def _gone_or_zombie(pid: int) -> bool:
    # an orphan killed with its group is reaped by init; a minimal init may leave it a zombie for a while
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_journal_timeout_keeps_what_was_printed(tmp_path):
    out = tmp_path / "j.out"
    out.write_text(JOURNAL_OUT)
    journalctl = _stub(tmp_path, "journalctl", f"cat {out}\nprintf '{{\"__CURSOR\":\"half'\nexec sleep 1000\n")
    obs = read_xid_events(f"journal:{journalctl}", None, timeout_s=0.5, boot_id=BOOT_A)
    assert obs.status.timed_out and not obs.status.complete
    assert len(obs.events) == 3  # complete entries before the hang are still reported
    assert obs.cursor["cursor"].endswith("x=6")  # the half-printed entry is not taken


DMESG_OUT = """<6>[    0.000000] Linux version 6.18.44
<4>[   10.000001] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
<6>[   10.000001] second record with the same timestamp
<4>[   12.500000] NVRM: Xid (PCI:0000:3b:00): 48, pid=7, name=p, DBE
               NVRM: Xid (PCI:0000:3b:00): 79, continuation line of a multi-line record
<14>[   13.000000] NVRM: Xid (PCI:0000:3b:00): 79, user record if dmesg prints real PRI values
"""


def test_dmesg_source_runs_kernel_raw_and_resumes_by_timestamp(tmp_path):
    dmesg, args = _printing_stub(tmp_path, "dmesg", DMESG_OUT)
    obs = read_xid_events(f"dmesg:{dmesg}", None, timeout_s=10, boot_id=BOOT_A)
    assert args.read_text().split("\n")[:2] == ["--kernel", "--raw"]
    assert obs.status.complete
    assert [(e.code, e.monotonic_s) for e in obs.events] == [(79, 10.000001), (48, 12.5)]
    assert obs.malformed == 1 and obs.rejected_non_kernel == 1 and obs.lines_scanned == 6
    assert obs.cursor == {"kind": "dmesg", "boot_id": BOOT_A, "monotonic_s": 13.0, "same_ts": 1}

    more = DMESG_OUT + "<4>[   13.000000] NVRM: Xid (PCI:0000:3b:00): 94, same timestamp as the cursor\n" \
        + "<4>[   20.000000] NVRM: Xid (PCI:0000:5d:00): 95, later\n"
    (tmp_path / "dmesg.out").write_text(more)
    new = read_xid_events(f"dmesg:{dmesg}", obs.cursor, timeout_s=10, boot_id=BOOT_A)
    assert [e.code for e in new.events] == [94, 95] and new.lines_scanned == 2
    assert new.cursor["monotonic_s"] == 20.0

    rebooted = read_xid_events(f"dmesg:{dmesg}", new.cursor, timeout_s=10, boot_id=BOOT_B)
    assert [e.code for e in rebooted.events] == [79, 48, 94, 95]


def test_dmesg_same_timestamp_records_are_not_lost_or_repeated():
    src = DmesgSource("dmesg", boot_id=BOOT_A)
    out1 = b"<4>[    5.000000] NVRM: Xid (PCI:0000:3b:00): 13, a\n"
    c = src.parse_output(out1, None).cursor
    out2 = out1 + b"<4>[    5.000000] NVRM: Xid (PCI:0000:3b:00): 13, b\n"
    obs = src.parse_output(out2, c)
    assert [e.detail for e in obs.events] == ["b"] and obs.cursor["same_ts"] == 2
    assert src.parse_output(out2, obs.cursor).events == []


def test_dmesg_permission_error_is_incomplete(tmp_path):
    dmesg = _stub(tmp_path, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n")
    cursor = {"kind": "dmesg", "boot_id": BOOT_A, "monotonic_s": 1.0, "same_ts": 1}
    obs = read_xid_events(f"dmesg:{dmesg}", cursor, timeout_s=10, boot_id=BOOT_A)
    assert not obs.status.complete and "not permitted" in obs.status.error and obs.cursor == cursor


# --------------------------------------------------------------------------- read_xid_events


@pytest.mark.parametrize("spec", ["bogus", "file:", "kmsg2", ""])
def test_unknown_spec_is_incomplete(spec):
    obs = read_xid_events(spec, None, timeout_s=1)
    assert not obs.status.complete and "ValueError" in obs.status.error


def test_make_source_specs(tmp_path):
    assert isinstance(make_source("kmsg", boot_id=BOOT_A), KmsgSource)
    assert make_source("kmsg:/tmp/x", boot_id=BOOT_A).spec == "kmsg:/tmp/x"
    assert isinstance(make_source("journal"), JournalSource)
    assert isinstance(make_source("dmesg"), DmesgSource)
    assert make_source(f"file:{tmp_path}/a:b.log").path == f"{tmp_path}/a:b.log"
    assert isinstance(make_source("auto"), (KmsgSource, JournalSource, DmesgSource))


def test_auto_never_raises():
    obs = read_xid_events("auto", None, timeout_s=10)
    assert isinstance(obs, KernelLogObservation) and obs.source


# --------------------------------------------------------------------------- cursors stored by earlier releases
# A fleet being upgraded has kernel-log cursors in its SQLite stores that the previous code wrote (the JSON below is
# exactly what probes/kernel_log.py and watch_follow.py stored for these contents; only path and inode vary). The
# one codec must read each of them, for the hooks and for the watch, and resume after it: nothing judged twice,
# nothing skipped.

OLD_KMSG = "".join(f"4,{s},{s * 1000},-;{'NVRM: Xid (PCI:0000:3b:00): 79, x' if s % 3 == 0 else 'ordinary'}\n"
                   for s in range(1, 8))
OLD_KERN_LOG = "Nov 20 10:11:12 n kernel: [ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, a\n"
OLD_CURSORS = {
    "kmsg-oldest": '{"kind": "kmsg", "seq": 7}',
    "kmsg": '{"kind": "kmsg", "boot_id": "%(boot)s", "seq": 7}',
    "kmsg-watch": '{"kind": "kmsg", "boot_id": "%(boot)s", "seq": 7, "path": "%(path)s", "inode": %(inode)d, '
                  '"offset": 190, "head": "1b404cbf9b8ac6149f9dc4a47da17fb6", "head_len": 190}',
    "file": '{"kind": "file", "path": "%(path)s", "inode": %(inode)d, "offset": 67, '
            '"head": "9411c63fdfb5322101df8d2e03a050f7", "head_len": 67}',
    "journal": '{"kind": "journal", "cursor": "s=6f1d;i=1a2c;b=2c5e;m=6de0b4f2;t=6410a0e6d1f41;x=2", '
               '"boot_id": "%(boot)s"}',
    "dmesg": '{"kind": "dmesg", "boot_id": "%(boot)s", "monotonic_s": 10.000001, "same_ts": 2}',
}


def _stored(tmp_path: Path, name: str, **values: object) -> dict:
    """The old cursor as the new code gets it: written into a real store's cursors table, read back by Store."""
    import sqlite3

    from gpuguard.store.sqlite import Store

    db = tmp_path / "state.db"
    Store(str(db)).close()
    text = OLD_CURSORS[name] % {"boot": BOOT_A, **values}
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT OR REPLACE INTO cursors VALUES (?, ?, ?)", ("kernel_log:n1", text, 1.0))
    with Store(str(db)) as st:
        cursor = st.get_cursor("kernel_log:n1")
    assert cursor == json.loads(text)
    return cursor


@pytest.mark.parametrize("name", ["kmsg-oldest", "kmsg", "kmsg-watch"])
def test_old_kmsg_cursors_resume_after_their_record(tmp_path, name):
    path = tmp_path / "kmsg"
    path.write_text(OLD_KMSG)
    cursor = _stored(tmp_path, name, path=str(path), inode=path.stat().st_ino)
    with open(path, "a") as f:
        f.write("4,8,8000,-;NVRM: Xid (PCI:0000:3b:00): 48, new\n4,9,9000,-;ordinary\n")
    obs = read_xid_events(f"kmsg:{path}", cursor, timeout_s=5, boot_id=BOOT_A)
    assert obs.status.complete and [(e.seq, e.code) for e in obs.events] == [(8, 48)]
    assert obs.cursor["seq"] == 9
    follower = make_follower(f"kmsg:{path}", cursor=cursor, boot_id=BOOT_A)
    batch = follower.poll()
    follower.close()
    assert batch is not None and batch.skip_seq_upto == 7  # the watch's judge skips records up to the cursor
    if name == "kmsg-watch":  # ... and this one also still knew where they ended in the file
        assert batch.data.count(b"\n") == 2
    new = [ln for ln in batch.data.splitlines() if int(ln.split(b",")[1]) > 7]
    assert new == [b"4,8,8000,-;NVRM: Xid (PCI:0000:3b:00): 48, new", b"4,9,9000,-;ordinary"]


def test_old_file_cursor_resumes_after_its_line(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(OLD_KERN_LOG)
    cursor = _stored(tmp_path, "file", path=str(path), inode=path.stat().st_ino)
    with open(path, "a") as f:
        f.write("Nov 20 10:11:13 n kernel: [ 2.0] NVRM: Xid (PCI:0000:3b:00): 94, b\n")
    obs = read_xid_events(f"file:{path}", cursor, timeout_s=5)
    assert obs.status.complete and [e.code for e in obs.events] == [94] and obs.lines_scanned == 1
    follower = make_follower(f"file:{path}", cursor=cursor, boot_id=None)
    batch = follower.poll()
    follower.close()
    assert batch is not None and batch.data.count(b"\n") == 1 and b": 94, b" in batch.data


def test_old_journal_cursor_is_resumed_by_journalctl(tmp_path):
    journalctl, args = _printing_stub(tmp_path, "journalctl", "")
    cursor = _stored(tmp_path, "journal")
    read_xid_events(f"journal:{journalctl}", cursor, timeout_s=10, boot_id=BOOT_A)
    assert f"--after-cursor={cursor['cursor']}" in args.read_text().split("\n")
    args.unlink()
    follower = make_follower(f"journal:{journalctl}", cursor=cursor, boot_id=BOOT_A, follow=False)
    while not follower.finished:
        follower.poll()
        time.sleep(0.01)
    follower.close()
    assert f"--after-cursor={cursor['cursor']}" in args.read_text().split("\n")


def test_old_dmesg_cursor_skips_what_it_covers(tmp_path):
    out = ("<4>[   10.000001] NVRM: Xid (PCI:0000:3b:00): 79, a\n<4>[   10.000001] NVRM: Xid (PCI:0000:3b:00): 79, b\n"
           "<4>[   10.000001] NVRM: Xid (PCI:0000:3b:00): 48, c\n<4>[   11.5] NVRM: Xid (PCI:0000:3b:00): 94, d\n")
    dmesg, _args = _printing_stub(tmp_path, "dmesg", out)
    cursor = _stored(tmp_path, "dmesg")
    obs = read_xid_events(f"dmesg:{dmesg}", cursor, timeout_s=10, boot_id=BOOT_A)
    assert [e.detail for e in obs.events] == ["c", "d"]
    follower = make_follower(f"dmesg:{dmesg}", cursor=cursor, boot_id=BOOT_A, follow=False)
    data = b""
    while not follower.finished:
        batch = follower.poll()
        data += batch.data if batch else b""
        time.sleep(0.01)
    follower.close()
    assert [ln.rsplit(b", ", 1)[1] for ln in data.splitlines()] == [b"c", b"d"]
