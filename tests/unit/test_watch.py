"""`gpuguard watch`: following (append, rotation, truncation, partial lines, restarts), judging (dedupe, forged
lines, non-fatal Xids) and the daemon (drains through a real scontrol executable and the real SQLite store,
keeps following while scontrol hangs, SIGTERM/SIGHUP, systemd notification).

Slurm is a small `scontrol` shell script here (tests/integration/test_watch.py uses a real cluster): it keeps the
node's state in files and logs every call, and can be told to hang or fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from simnode import gpuguard_dirs

from gpuguard.siteconfig import parse_config
from gpuguard.util.log import HookLog
from gpuguard.kernellog.base import FollowError, KernelLogSource, kmsg_readable
from gpuguard.kernellog.file import FileSource
from gpuguard.kernellog.formats import Verdict, parse_kernel_log_line
from gpuguard.kernellog.journal import JournalSource
from gpuguard.kernellog.kmsg import KmsgSource
from gpuguard.kernellog.sources import make_follower
from gpuguard.slurm.reason import parse_reason
from gpuguard.store.sqlite import Store
from gpuguard.watch.loop import WatchDaemon
from gpuguard.watch.settings import cursor_name
from gpuguard.watch.systemd import sd_notify
from gpuguard.watch.judge import WatchEvent, WatchJudge, XidDeduper, node_verdict, xid_line_spans
from gpuguard.xid.catalog import load_catalog

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kernel_log"
BOOT_A = "11111111-2222-3333-4444-555555555555"
BOOT_B = "99999999-8888-7777-6666-555555555555"
REPO = Path(__file__).resolve().parents[2]


def xid_line(code: int, bus: str = "3b", detail: str = "GPU has fallen off the bus.", pid: str = "'<unknown>'") -> str:
    """A kern.log (rsyslog imklog) line, as on a real node."""
    return (f"Nov 20 10:11:12 gpu-node-1 kernel: [ 5234.567890] NVRM: Xid (PCI:0000:{bus}:00): {code}, "
            f"pid={pid}, name=<unknown>, {detail}\n")


def kmsg_record(seq: int, text: str, pri: int = 4) -> str:
    return f"{pri},{seq},{1_000_000 * (100 + seq)},-;{text}\n"


def wait_for(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def file_follower(path: str, cursor: Optional[dict[str, Any]] = None, at_end: bool = False) -> FileSource:
    f = FileSource(path)
    f.follow(cursor, start_at="end" if at_end else "boot")
    return f


def journal_follower(journalctl: str, cursor: Optional[dict[str, Any]] = None, **kw: Any) -> JournalSource:
    j = JournalSource(journalctl, **kw)
    j.follow(cursor)
    return j


def drain_reason(we: WatchEvent) -> Optional[str]:
    return node_verdict(list(we.findings)).reason


def read_all(follower: KernelLogSource) -> bytes:
    out = b""
    while True:
        b = follower.poll()
        if b is None:
            return out
        out += b.data


# --------------------------------------------------------------------------- fake scontrol


SCONTROL = r"""#!/bin/sh
# a one-node Slurm for tests: state and reason in files beside this script, every call logged (a drain once its
# reason is there to read: a test that saw the call may read the reason at once)
d=$(dirname "$0")
log() { echo "$*" >> "$d/calls.log"; }
if [ -f "$d/hang" ]; then log "$@"; exec sleep 60; fi
if [ -f "$d/fail" ]; then log "$@"; echo "slurm_load_node error: Unable to contact slurm controller" >&2; exit 1; fi
case "$1" in
  show)
    log "$@"
    st=$(cat "$d/state" 2>/dev/null || echo IDLE)
    if [ -f "$d/reason" ]; then r=" Reason=$(cat "$d/reason") [root@2024-01-01T00:00:00]"; else r=""; fi
    echo "NodeName=$3 Arch=x86_64 State=$st Partitions=gpu$r" ;;
  update)
    printf '%s' "${4#Reason=}" > "$d/reason"; echo "IDLE+DRAIN" > "$d/state"; log "$@" ;;
  *) log "$@" ;;
esac
"""


class FakeSlurm:
    def __init__(self, root: Path) -> None:
        self.dir = root / "slurm"
        self.dir.mkdir()
        self.scontrol = self.dir / "scontrol"
        self.scontrol.write_text(SCONTROL)
        self.scontrol.chmod(0o755)

    def calls(self) -> list[str]:
        p = self.dir / "calls.log"
        return p.read_text().splitlines() if p.exists() else []

    def drains(self) -> list[str]:
        return [c for c in self.calls() if c.startswith("update ")]

    def reason(self) -> Optional[str]:
        p = self.dir / "reason"
        return p.read_text() if p.exists() else None

    def set(self, name: str, on: bool = True, text: str = "") -> None:
        p = self.dir / name
        if on:
            p.write_text(text)
        elif p.exists():
            p.unlink()


@pytest.fixture
def slurm(tmp_path: Path) -> FakeSlurm:
    return FakeSlurm(tmp_path)


def config_text(tmp_path: Path, slurm: FakeSlurm, source: str, watch: Optional[dict[str, Any]] = None,
                extra: str = "") -> str:
    w = {"source": source, "retry_initial_s": 0.2, "retry_max_s": 0.5, **(watch or {})}
    return (f"store: {{path: {json.dumps(str(tmp_path / 'state' / '{node}.db'))}}}\n"
            f"slurm: {{scontrol: {slurm.scontrol}, backend: cli}}\n"
            f"logging: {{syslog: false, file: {tmp_path}/gpuguard.log}}\n"
            f"deadlines: {{scontrol_s: 0.5}}\n"
            f"watch: {json.dumps(w)}\n" + extra)


class Running:
    """A WatchDaemon in a thread of this process (signals are tested on the real CLI below)."""

    def __init__(self, tmp_path: Path, slurm: FakeSlurm, source: str, watch: Optional[dict[str, Any]] = None,
                 extra: str = "", once: bool = False, config_file: Optional[Path] = None) -> None:
        """`config_file`: the config is written there and the daemon told its path (as `--config` does)."""
        text = config_text(tmp_path, slurm, source, watch, extra)
        if config_file is not None:
            config_file.write_text(text)
        self.cfg = parse_config(text, str(config_file or "test.yaml"))
        self.store_path = tmp_path / "state" / "n1.db"
        self.daemon = WatchDaemon(self.cfg, node="n1", once=once, config_path=config_file and str(config_file),
                                  log=HookLog(use_syslog=False, path=str(tmp_path / "gpuguard.log"), stderr=False))
        self.code: Optional[int] = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.code = self.daemon.run()

    def __enter__(self) -> "Running":
        self.thread.start()
        assert self.daemon.ready.wait(10), "watch did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.daemon.request_stop()
        self.thread.join(10)
        assert not self.thread.is_alive()

    def store(self) -> Store:
        return Store(str(self.store_path))

    def runs(self) -> list[dict[str, Any]]:
        with self.store() as st:
            runs = st.runs(node="n1")
            for r in runs:
                r["findings"] = st.findings_for(r["id"])
            return runs

    def drain_rows(self) -> list[dict[str, Any]]:
        with self.store() as st:
            return st.drains(node="n1")

    def cursor(self) -> Optional[dict[str, Any]]:
        with self.store() as st:
            return st.get_cursor(cursor_name("n1"))

    def journal(self) -> Any:
        """The node's verdict journal (pending drains), shared with the hooks."""
        from gpuguard.pipeline.journal import journal_for

        return journal_for(self.cfg, "n1")


# --------------------------------------------------------------------------- following a file


def test_file_follower_returns_new_complete_lines_and_holds_a_partial_one(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("old line 1\nold line 2\n")
    f = file_follower(str(log), at_end=True)
    assert f.poll() is None  # the file's history is not re-judged on a first start at the end
    append(log, "new 1\nnew 2 start")
    assert read_all(f) == b"new 1\n"
    assert f.poll() is None  # "new 2 start" has no newline yet: not a complete line
    append(log, " and end\n")
    b = f.poll()
    assert b.data == b"new 2 start and end\n"
    cur = b.cursor_at(len(b.data))
    assert cur["kind"] == "file" and cur["offset"] == log.stat().st_size and cur["inode"] == log.stat().st_ino


def test_file_follower_reads_a_truncated_file_from_the_start(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a\nb\nc\n")
    f = file_follower(str(log), cursor=None)
    assert read_all(f) == b"a\nb\nc\n"
    with open(log, "r+") as fh:  # logrotate copytruncate
        fh.truncate(0)
    append(log, "x\n")
    assert read_all(f) == b"x\n"
    assert f.stats.truncations == 1 and any("truncated" in n for n in f.notes)


def test_file_follower_notices_a_rewrite_that_grew_past_the_offset(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("first\n")
    f = file_follower(str(log))
    assert read_all(f) == b"first\n"
    log.write_text("other content, longer than before\n")  # same inode, new bytes from the start
    assert read_all(f) == b"other content, longer than before\n"


def test_file_follower_survives_rotation_and_reads_the_old_files_last_lines(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("1\n")
    f = file_follower(str(log))
    assert read_all(f) == b"1\n"
    os.rename(log, tmp_path / "kern.log.1")
    append(tmp_path / "kern.log.1", "2 written just before the writer reopened\n3 without newline")
    assert read_all(f) == b"2 written just before the writer reopened\n3 without newline\n"
    assert f.poll() is None  # kern.log does not exist yet
    append(log, "4 in the new file\n")
    assert read_all(f) == b"4 in the new file\n"
    assert f.stats.rotations == 1


def test_file_follower_waits_for_a_missing_file(tmp_path):
    log = tmp_path / "kern.log"
    f = file_follower(str(log), at_end=True)
    assert f.poll() is None and any("does not exist" in n for n in f.notes)
    append(log, "hello\n")
    assert read_all(f) == b"hello\n"  # a file created after the start is new: all of it counts


def test_file_follower_resumes_from_its_cursor_and_distrusts_a_stale_one(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    f = file_follower(str(log))
    b = f.poll()
    cursor = b.cursor_at(len(b.data))
    f.close()
    append(log, "c\n")
    f2 = file_follower(str(log), cursor=cursor)
    assert read_all(f2) == b"c\n"
    stale = dict(cursor, head="0" * 32)  # the file's first bytes changed since: a different file
    assert read_all(file_follower(str(log), cursor=stale)) == b"a\nb\nc\n"
    replaced = dict(cursor, inode=cursor["inode"] + 1)
    assert read_all(file_follower(str(log), cursor=replaced)) == b"a\nb\nc\n"


def test_file_follower_skips_an_overlong_line_without_holding_it(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    f = file_follower(str(log))
    append(log, "x" * (200 << 10))
    assert f.poll() is None
    append(log, "NVRM: Xid tail of the long line\nok\n")
    assert read_all(f) == b"ok\n"
    assert f.stats.lines_skipped_overlong == 1


def test_kmsg_file_cursor_resumes_in_the_same_boot_and_starts_over_in_a_new_one(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(kmsg_record(1, "hello") + kmsg_record(2, "world"))
    f = make_follower(f"kmsg:{kmsg}", cursor=None, boot_id=BOOT_A)
    b = f.poll()
    cursor = b.cursor_at(len(b.data))
    assert cursor["kind"] == "kmsg" and cursor["seq"] == 2 and cursor["boot_id"] == BOOT_A
    assert b.cursor_at(len(kmsg_record(1, "hello")))["seq"] == 1
    append(kmsg, kmsg_record(3, "again"))
    assert read_all(make_follower(f"kmsg:{kmsg}", cursor=cursor, boot_id=BOOT_A)) == kmsg_record(3, "again").encode()
    assert len(read_all(make_follower(f"kmsg:{kmsg}", cursor=cursor, boot_id=BOOT_B)).splitlines()) == 3
    # the file was rewritten in the same boot (position unusable): records up to the cursor's seq are skipped
    moved = dict(cursor, inode=-1)
    f3 = make_follower(f"kmsg:{kmsg}", cursor=moved, boot_id=BOOT_A)
    b3 = f3.poll()
    assert b3.skip_seq_upto == 2


def test_unfollowable_sources_are_refused_clearly(tmp_path):
    with pytest.raises(FollowError, match="unknown kernel log source"):
        make_follower("syslog:/x", cursor=None, boot_id=None)
    with pytest.raises(FollowError, match="does not exist"):
        make_follower(f"kmsg:{tmp_path}/nope", cursor=None, boot_id=None)


def test_dmesg_is_followed_and_a_restarted_dmesg_repeats_nothing(tmp_path):
    """`dmesg --follow` prints the whole ring buffer first, and again after every restart: only records after the
    cursor (by timestamp, counting records that share one) reach the judge."""
    from gpuguard.kernellog.dmesg import DmesgSource

    out = tmp_path / "dmesg.out"
    out.write_text("<6>[    1.000000] Linux version 6.1\n<4>[    2.000000] NVRM: Xid (PCI:0000:3b:00): 13, first\n")
    argv_log = tmp_path / "argv.log"
    stub = tmp_path / "dmesg"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {argv_log}\ncat {out}\nexit 0\n')  # exits: dmesg died
    stub.chmod(0o755)
    f = DmesgSource(str(stub), boot_id=BOOT_A, restart_initial_s=0.05)
    f.follow({"kind": "dmesg", "boot_id": BOOT_A, "monotonic_s": 1.0, "same_ts": 1})
    try:
        b = wait_for(lambda: f.poll(), what="dmesg output")
        assert b.data == b"<4>[    2.000000] NVRM: Xid (PCI:0000:3b:00): 13, first\n"
        assert b.cursor_at(len(b.data)) == {"kind": "dmesg", "boot_id": BOOT_A, "monotonic_s": 2.0, "same_ts": 1}
        assert b.cursor_at(0)["monotonic_s"] == 1.0
        append(out, "<4>[    3.000000] NVRM: Xid (PCI:0000:3b:00): 79, second\n")
        b2 = wait_for(lambda: f.poll(), what="the restarted dmesg's news")
        assert b2.data == b"<4>[    3.000000] NVRM: Xid (PCI:0000:3b:00): 79, second\n"
        assert argv_log.read_text().splitlines()[0] == "--kernel --raw --follow"
        assert f.stats.restarts >= 1
    finally:
        f.close()


# --------------------------------------------------------------------------- /dev/kmsg and journalctl
# The host's kernel log is only ever read here: a forged `NVRM: Xid` record written to the real /dev/kmsg would be
# seen by every other health tool on a developer's GPU machine (NHC's check_cmd_dmesg, DCGM, gpud) as a real fault.
# Records the tests need come from kernel-log sources of their own (tests/conftest.py refuses any write).


def _fake_kmsg_device(path: Path) -> int:
    """A FIFO standing in for /dev/kmsg: not a regular file (so the source takes its device path: non-blocking
    reads, woken by poll), one record per write and, read before the next write, one record per read(2) as the
    device hands them out. Returns the write end."""
    os.mkfifo(path)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)  # read-write: the FIFO never reports a hang-up meanwhile


def test_kmsg_device_follower_wakes_on_a_record_and_never_trusts_userspace(tmp_path):
    import select

    dev = tmp_path / "kmsg"
    w = _fake_kmsg_device(dev)
    f = KmsgSource(str(dev), boot_id=BOOT_A)
    f.follow(None, start_at="auto")
    try:
        assert f.poll() is None
        p = select.poll()
        p.register(f.wait_fd(), select.POLLIN)
        assert not p.poll(50), "readable with no record written"
        # a userspace write of "<0>NVRM: Xid ..." to /dev/kmsg: the kernel files it under facility 1 (user), PRI 8+
        os.write(w, kmsg_record(41, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=forger, forged", pri=8).encode())
        assert p.poll(2000), "poll did not report the new record"
        b = f.poll()
        assert parse_kernel_log_line(b.data.decode().strip()).verdict == Verdict.NON_KERNEL  # never drains
        c = b.cursor_at(len(b.data))
        assert (c["kind"], c["boot_id"], c["seq"]) == ("kmsg", BOOT_A, 41)
        assert not p.poll(50) and f.poll() is None
        os.write(w, kmsg_record(42, "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has "
                                    "fallen off the bus.").encode())
        assert p.poll(2000), "poll did not report the kernel's record"
        b = f.poll()
        res = parse_kernel_log_line(b.data.decode().strip())
        assert res.verdict == Verdict.XID and res.seq == 42 and b.cursor_at(len(b.data))["seq"] == 42
    finally:
        f.close()
        os.close(w)


@pytest.mark.skipif(not kmsg_readable("/dev/kmsg"), reason="/dev/kmsg not readable here")
def test_real_kmsg_device_follower_reads_this_boots_records_and_resumes_after_its_cursor():
    """The real /dev/kmsg, read only: the records already there wake the follower, and a restart from the cursor
    hands out nothing up to it."""
    import select

    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    f = KmsgSource("/dev/kmsg", boot_id=boot)
    f.follow(None, start_at="auto")
    try:
        p = select.poll()
        p.register(f.wait_fd(), select.POLLIN)
        assert p.poll(2000), "this boot's records did not wake the follower"
        last, cursor = b"", None
        while (b := f.poll()) is not None:
            last, cursor = b.data.splitlines()[-1], b.cursor_at(len(b.data))
    finally:
        f.close()
    assert cursor is not None and cursor["kind"] == "kmsg" and cursor["boot_id"] == boot and cursor["seq"] >= 0
    again = make_follower("kmsg:/dev/kmsg", cursor=cursor, boot_id=boot)
    try:
        assert last not in read_all(again).splitlines()
    finally:
        again.close()


def _real_dmesg_works() -> bool:
    try:
        return subprocess.run(["dmesg", "--kernel", "--raw"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _userspace_records_in_this_boot() -> list[bytes]:
    """Messages of records userspace wrote to /dev/kmsg this boot (systemd's, for one), from `dmesg --decode`."""
    p = subprocess.run(["dmesg", "--decode"], capture_output=True, timeout=10)
    out = []
    for line in p.stdout.splitlines():
        facility, _, rest = line.partition(b":")
        if facility.strip() not in (b"kern", b"") and b"] " in rest:
            out.append(rest.split(b"] ", 1)[1].strip())
    return [m for m in out if m]


@pytest.mark.skipif(not _real_dmesg_works(), reason="needs util-linux dmesg and a readable kernel log")
def test_real_dmesg_follow_resumes_and_never_returns_userspace_records():
    """The real `dmesg`, read only: the follower resumes after its cursor, and none of the records userspace wrote
    to this boot's kernel log (when there are any) reaches the judge (`--kernel`)."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    users = _userspace_records_in_this_boot()
    f = make_follower("dmesg", cursor=None, boot_id=boot)  # start_at auto: this boot's buffer
    try:
        first = wait_for(lambda: f.poll(), what="this boot's kernel records")
        cursor = first.cursor_at(len(first.data))
        seen = first.data
        while cursor["monotonic_s"] == 0:  # the first read may end among the early records, all at [0.000000]
            more = wait_for(lambda: f.poll(), what="records after the first ones")
            cursor = more.cursor_at(len(more.data))
            seen += more.data
        assert cursor["kind"] == "dmesg" and cursor["boot_id"] == boot and cursor["monotonic_s"] > 0
        time.sleep(0.3)
        seen += read_all(f)
        messages = {line.split(b"] ", 1)[-1].strip() for line in seen.splitlines()}
        assert not messages & set(users)  # `--kernel`: a userspace record never reaches the judge
    finally:
        f.close()
    again = make_follower("dmesg", cursor=cursor, boot_id=boot, follow=False)
    try:
        data = b""
        while not again.finished:
            data += read_all(again)
            time.sleep(0.01)
    finally:
        again.close()
    assert first.data.splitlines()[-1] not in data.splitlines()  # resumed after the cursor


def _journal_lines() -> list[str]:
    return [ln for ln in (FIXTURES / "journal_json.txt").read_text().splitlines() if ln.startswith("{")]


def test_journal_follower_restarts_journalctl_after_the_last_cursor(tmp_path):
    lines = _journal_lines()
    out = tmp_path / "journal.out"
    out.write_text("\n".join(lines) + "\n")
    argv_log = tmp_path / "argv.log"
    stub = tmp_path / "journalctl"
    # prints the recorded entries once, then exits (as journalctl does when journald restarts)
    stub.write_text(f"#!/bin/sh\necho \"$*\" >> {argv_log}\n"
                    f"if [ ! -f {tmp_path}/done ]; then touch {tmp_path}/done; cat {out}; fi\nexit 1\n")
    stub.chmod(0o755)
    f = journal_follower(str(stub), boot_id=BOOT_A, restart_initial_s=0.05)
    data = wait_for(lambda: f.poll(), what="journal output")
    assert data.json_lines and data.data.count(b"\n") >= 1
    judged = read_all(f) + data.data
    assert judged.count(b"\n") == len(lines)
    wait_for(lambda: (f.poll(), len(argv_log.read_text().splitlines()) >= 2)[1], what="a restart")
    last_cursor = [json.loads(ln)["__CURSOR"] for ln in lines if "__CURSOR" in ln][-1]
    first, second = argv_log.read_text().splitlines()[:2]
    assert "-k -o json" in first and "-f" in first and "--lines=all" in first
    assert f"--after-cursor={last_cursor}" in second
    f.close()


def test_journal_follower_gives_up_a_cursor_journalctl_cannot_seek_to(tmp_path):
    argv_log = tmp_path / "argv.log"
    stub = tmp_path / "journalctl"
    stub.write_text(f"#!/bin/sh\necho \"$*\" >> {argv_log}\n"
                    "case \"$*\" in *--after-cursor=*) echo 'Failed to seek to cursor: Invalid argument' >&2; "
                    "exit 1;; esac\nexec sleep 30\n")
    stub.chmod(0o755)
    f = journal_follower(str(stub), cursor={"kind": "journal", "cursor": "s=gone;i=1", "boot_id": BOOT_A},
                        boot_id=BOOT_A, restart_initial_s=0.05)
    try:
        wait_for(lambda: (f.poll(), argv_log.exists() and len(argv_log.read_text().splitlines()) >= 2)[1],
                 what="the restart")
        first, second = argv_log.read_text().splitlines()[:2]
        assert "--after-cursor=s=gone;i=1" in first
        # not --lines=all: re-reading the whole boot could drain again for an Xid already acted on
        assert "--lines=0" in second and "--after-cursor" not in second
        assert any("cannot resume after the saved cursor" in n for n in f.notes)
    finally:
        f.close()


# --------------------------------------------------------------------------- judging


def test_xid_line_spans_finds_only_xid_lines_including_json_byte_arrays():
    data = b"a\nkernel: NVRM: Xid (PCI:0000:3b:00): 79, x\nb\n" + b'{"MESSAGE":[78,86,82,77,58,32,88,105,100]}\n'
    spans = list(xid_line_spans(data))
    assert [data[s:e] for s, e in spans] == [b"kernel: NVRM: Xid (PCI:0000:3b:00): 79, x"]
    assert len(list(xid_line_spans(data, json_lines=True))) == 2


def test_dedupe_folds_repeats_of_the_same_code_on_the_same_gpu_within_the_window():
    d = XidDeduper(window_s=10)
    assert d.admit((13, "0000:3b:00"), 0.0) == 0
    assert d.admit((13, "0000:3b:00"), 5.0) is None
    assert d.admit((13, "0000:3b:00"), 9.9) is None
    assert d.admit((13, "0000:86:00"), 9.9) == 0  # another GPU is another event
    assert d.admit((31, "0000:3b:00"), 9.9) == 0  # another code too
    assert d.admit((13, "0000:3b:00"), 10.0) == 2  # after the window: an event, with what was folded


def test_forged_lines_can_neither_start_nor_extend_a_dedupe_window():
    judge = WatchJudge(load_catalog(), window_s=60)
    forged = "Nov 20 10:11:12 gpu-node-1 alice: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off"
    for _ in range(3):
        assert judge.judge_bytes(forged.encode(), 0.0) is None
    real = judge.judge_bytes(xid_line(79).encode(), 1.0)
    assert real is not None and real.fatal and real.repeats_before == 0
    assert judge.judge_bytes(forged.encode(), 2.0) is None  # folded now, but never an event either way
    assert judge.counts.forged == 3 and judge.counts.events == 1


def test_judge_over_every_fixture_finds_exactly_the_kernel_xids():
    """All real-world fixture lines through a followed file: the events are exactly the `#= xid` lines."""
    judge = WatchJudge(load_catalog(), window_s=0)  # no folding: every line is its own event
    expected, got = [], []
    for path in sorted(FIXTURES.glob("*.txt")):
        want = None
        for line in path.read_text().splitlines():
            if line.startswith("#="):
                want = line.split()[1:3]
                continue
            if line.startswith("#") or not line.strip():
                continue
            if want and want[0] == "xid":
                expected.append(int(want[1].split("=")[1]))
            want = None
            we = judge.judge_bytes(line.encode(), now=0.0)
            if we is not None:
                got.append(we.event.code)
    assert got == expected and len(expected) > 40
    assert judge.counts.forged >= 8 and judge.counts.malformed >= 5


def test_reasons_have_the_prolog_shape_and_the_catalog_action():
    cat = load_catalog()
    judge = WatchJudge(cat, window_s=60)
    we = judge.judge_bytes(xid_line(79, "86").encode(), 0.0)
    assert drain_reason(we) == "gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [watch reboot]"
    p = parse_reason(drain_reason(we))
    assert (p.check_id, p.keyword, p.context, p.action) == ("gpu.xid", "XID79", "watch", "reboot")
    we48 = judge.judge_bytes(xid_line(48, "53", "DBE (0x1,0x2) in FBHUB").encode(), 0.0)
    assert drain_reason(we48).endswith("[watch reset]")
    # Xid 154 names its own recovery action in the message
    we154 = judge.judge_bytes(xid_line(154, "9b", "GPU recovery action changed from 0x0 (None) to 0x2 "
                                       "(Node Reboot Required)").encode(), 0.0)
    assert drain_reason(we154).endswith("[watch reboot]")
    we13 = judge.judge_bytes(xid_line(13, "3b", "Graphics SM Warp Exception", pid="4242").encode(), 0.0)
    (f,) = we13.findings  # the health check's own finding for the line, with who hit it
    assert not we13.fatal and f.severity.value == "ok" and f.message.startswith("non-fatal Xid 13 in the kernel log")
    assert (f.evidence["pid"], f.evidence["xids"][0]["code"]) == (4242, 13)


# --------------------------------------------------------------------------- the daemon


def test_fatal_xid_is_drained_recorded_and_the_cursor_moves_past_it(tmp_path, slurm):
    log = tmp_path / "kern.log"
    log.write_text(xid_line(79, "aa"))  # history from before the watch started: not this watch's business
    with Running(tmp_path, slurm, f"file:{log}") as w:
        append(log, "Nov 20 10:11:13 gpu-node-1 kernel: [ 5235.0] eth0: link up\n" + xid_line(79, "86"))
        wait_for(lambda: slurm.drains(), what="a drain")
        wait_for(lambda: w.cursor() and w.cursor()["offset"] == log.stat().st_size, what="the cursor")
    assert slurm.drains() == ["update NodeName=n1 State=DRAIN Reason=gpuguard: XID79 gpu.xid: GPU has fallen off "
                              "the bus on 0000:86:00 [watch reboot]"]
    runs = w.runs()
    assert [(r["kind"], r["verdict"]) for r in runs] == [("watch", "drain")]
    f = runs[0]["findings"][0]
    assert (f["check_id"], f["severity"], f["keyword"], f["action"]) == ("gpu.xid", "fail", "XID79", "reboot")
    d = w.drain_rows()[0]
    assert (d["op"], d["outcome"], d["run_id"], d["reason"]) == ("drain", "done", runs[0]["id"], slurm.reason())
    assert w.code == 0


def test_restart_resumes_from_the_cursor_and_never_redrains_an_old_xid(tmp_path, slurm):
    kmsg = tmp_path / "kmsg"  # a simulated node's kernel log: kmsg records, cursor by sequence number
    kmsg.write_text(kmsg_record(1, "Linux version 6.1"))
    with Running(tmp_path, slurm, f"kmsg:{kmsg}"):
        append(kmsg, kmsg_record(2, "NVRM: Xid (PCI:0000:86:00): 79, pid=<unknown>, name=<unknown>, off the bus"))
        wait_for(lambda: slurm.drains(), what="the first drain")
    # an admin repaired the node and returned it with `gpuguard undrain --force` (recorded: the condition clears)
    from gpuguard.pipeline.admin import record_admin_clear

    record_admin_clear(Running(tmp_path, slurm, f"kmsg:{kmsg}").cfg, "n1", "admin --force", HookLog(use_syslog=False))
    slurm.set("state", text="IDLE")
    slurm.set("reason", on=False)
    with Running(tmp_path, slurm, f"kmsg:{kmsg}") as w:
        append(kmsg, kmsg_record(3, "NVRM: Xid (PCI:0000:86:00): 13, pid=7, name=python, Graphics Exception"))
        wait_for(lambda: len(w.runs()) == 2, what="the Xid 13 run")
        time.sleep(0.3)
    assert len(slurm.drains()) == 1  # the old Xid 79 was not judged again
    assert w.daemon.judge.counts.events == 1
    assert w.cursor()["seq"] == 3


def test_a_plain_resume_while_a_condition_stands_is_drained_again_by_the_watch(tmp_path, slurm):
    """Issue 27: the fatal Xid 79 is a condition of the node (reboot-class). An admin's plain `scontrol update
    state=resume` does not clear it: the running watch drains the node again within watch.agree_s, with a reason
    that says how to clear it; the Xid itself is not judged a second time."""
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(kmsg_record(1, "NVRM: Xid (PCI:0000:86:00): 79, pid=<unknown>, name=<unknown>, off the bus"))
    with Running(tmp_path, slurm, f"kmsg:{kmsg}", watch={"agree_s": 0.3}) as w:
        wait_for(lambda: slurm.drains(), what="the first drain")
        (c,) = w.journal().conditions
        assert (c.keyword, c.check_id, c.action, c.origin) == ("XID79", "gpu.xid", "reboot", "watch")
        slurm.set("state", text="IDLE")  # scontrol update nodename=n1 state=resume
        slurm.set("reason", on=False)
        wait_for(lambda: len(slurm.drains()) == 2, what="the drain after the resume", timeout=15)
    assert "[standing reboot]" in slurm.reason() and "reboot the node" in slurm.reason()
    assert w.daemon.judge.counts.events == 1


def test_xid13_flood_costs_little_and_drains_nothing(tmp_path, slurm):
    log = tmp_path / "kern.log"
    log.write_text("")
    n = 40_000
    flood = "".join(xid_line(13, f"{0x10 + i % 8:02x}", "Graphics SM Warp Exception", pid=str(1000 + i % 50))
                    for i in range(n))
    with Running(tmp_path, slurm, f"file:{log}") as w:
        cpu0 = time.process_time()
        append(log, flood)
        wait_for(lambda: w.daemon.judge.counts.xid_lines == n, timeout=30, what="the flood to be judged")
        cpu = time.process_time() - cpu0
        wait_for(lambda: len(w.runs()) == 8, what="one record per GPU")
    assert slurm.drains() == []
    assert w.daemon.judge.counts.duplicates == n - 8
    per_line_us = cpu / n * 1e6
    print(f"Xid 13 flood: {n} lines judged, {per_line_us:.1f} us CPU per line")
    assert per_line_us < 60, per_line_us  # ~10 us here: parsing only, no store or Slurm work per line


def test_non_fatal_and_forged_lines_are_recorded_not_drained(tmp_path, slurm):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    with Running(tmp_path, slurm, f"kmsg:{kmsg}", {"dedupe_window_s": 0.1}) as w:
        append(kmsg, kmsg_record(1, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, forged", pri=12)
               + kmsg_record(2, "NVRM: Xid (PCI:0000:3b:00): 31, pid=7, name=python, MMU Fault"))
        wait_for(lambda: len(w.runs()) == 2, what="two runs")
    assert slurm.drains() == []
    messages = sorted(r["findings"][0]["message"] for r in w.runs())
    assert messages[0].startswith("1 Xid-looking line(s) not from the kernel ignored")
    assert messages[1].startswith("non-fatal Xid 31 in the kernel log: recorded")


def test_nvlink5_events_get_the_health_checks_verdict_in_the_daemon(tmp_path, slurm):
    """Real B200/GB200 lines (tests/fixtures/kernel_log/nvlink5_and_driver.txt): the driver's Nonfatal event is
    recorded, its Fatal one drains for a GPU reset, as the health check decides."""
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    with Running(tmp_path, slurm, f"kmsg:{kmsg}") as w:
        append(kmsg, kmsg_record(1, "NVRM: Xid (PCI:0000:5f:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 02"))
        wait_for(lambda: len(w.runs()) == 1, what="the Nonfatal event's record")
        assert slurm.drains() == []
        append(kmsg, kmsg_record(2, "NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 "
                                    "(0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"))
        wait_for(lambda: slurm.drains(), what="the drain for the Fatal event")
    assert slurm.reason() == "gpuguard: XID149 gpu.xid: NVLINK: NETIR Error on 0000:00:00 [watch reset]"
    nonfatal = [r for r in w.runs() if r["verdict"] == "warn"][0]["findings"][0]
    assert (nonfatal["severity"], nonfatal["keyword"]) == ("warn", "XID145")


def test_admin_drained_node_keeps_its_reason(tmp_path, slurm):
    slurm.set("state", text="IDLE+DRAIN")
    slurm.set("reason", text="admin: bad PSU [ticket 7]")
    log = tmp_path / "kern.log"
    log.write_text("")
    with Running(tmp_path, slurm, f"file:{log}") as w:
        append(log, xid_line(79))
        wait_for(lambda: w.drain_rows(), what="the drain record")
    assert slurm.drains() == [] and slurm.reason() == "admin: bad PSU [ticket 7]"
    assert w.drain_rows()[0]["outcome"] == "foreign"


def test_report_policy_records_but_never_drains(tmp_path, slurm):
    log = tmp_path / "kern.log"
    log.write_text("")
    with Running(tmp_path, slurm, f"file:{log}", extra="policy: {on_failure: report}\n") as w:
        append(log, xid_line(79))
        wait_for(lambda: w.drain_rows(), what="the drain record")
    assert slurm.calls() == []
    assert w.drain_rows()[0]["outcome"] == "skipped" and w.runs()[0]["verdict"] == "warn"


def test_a_fault_back_after_reboots_escalates_to_replace(tmp_path, slurm):
    """Xid 79 drained this node in two earlier boots (the prolog's or the watch's drains alike): rebooting does
    not fix it, so this time the reason asks for hardware inspection."""
    (tmp_path / "state").mkdir()
    with Store(str(tmp_path / "state" / "n1.db")) as st:
        for boot in ("boot-1", "boot-2"):
            run_id = st.record_run(started=time.time() - 3600, duration_ms=1, node="n1", kind="prolog", job_id="1",
                                   profile=None, verdict="drain", action="reboot", reason="x", exit_code=1,
                                   error=None, boot_id=boot, findings=[])
            st.record_drain(node="n1", op="drain", outcome="done", check_id="gpu.xid", action="reboot",
                            reason="gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot]",
                            run_id=run_id, ts=time.time() - 3600)
    log = tmp_path / "kern.log"
    log.write_text("")
    with Running(tmp_path, slurm, f"file:{log}"):
        append(log, xid_line(79, "86"))
        wait_for(lambda: slurm.drains(), what="the drain")
    p = parse_reason(slurm.reason())
    assert (p.keyword, p.context, p.action) == ("XID79", "watch", "replace"), slurm.reason()
    assert "back after 2 reboots" in p.detail


def test_a_drain_is_notified_through_gpuguard_notify(tmp_path, slurm):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    got: list[dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    log = tmp_path / "kern.log"
    log.write_text("")
    notify = f"notify: {{urls: [json://127.0.0.1:{httpd.server_address[1]}/hook]}}\n"
    try:
        with Running(tmp_path, slurm, f"file:{log}", extra=notify):
            append(log, xid_line(79, "86"))
            wait_for(lambda: got, what="the webhook")
    finally:
        httpd.shutdown()
    text = json.dumps(got[0])
    assert "n1" in text and "XID79" in text and "[watch reboot]" in text


def test_a_hung_scontrol_does_not_stop_following_and_the_drain_is_retried(tmp_path, slurm):
    log = tmp_path / "kern.log"
    log.write_text("")
    slurm.set("hang")
    with Running(tmp_path, slurm, f"file:{log}") as w:
        append(log, "Nov 20 10:11:11 gpu-node-1 kernel: [ 1.0] boot\n")
        wait_for(lambda: w.cursor(), what="the first cursor")
        before_xid = log.stat().st_size
        append(log, xid_line(79, "86"))
        wait_for(lambda: slurm.calls(), what="the first (hanging) scontrol call")
        t0 = time.monotonic()
        append(log, xid_line(13, "3b", "Graphics Exception") + xid_line(48, "53", "DBE"))
        # the main thread judged the new lines while scontrol hung
        wait_for(lambda: w.daemon.judge.counts.events == 3, timeout=1.0, what="following to go on")
        assert time.monotonic() - t0 < 1.0
        wait_for(lambda: any(d["outcome"] == "failed" for d in w.drain_rows()), what="the failed attempt")
        # pending in the verdict journal (a prolog refuses jobs meanwhile, a restart applies it): the cursor moves on
        assert [p.reason[:15] for p in w.journal().pending][:1] == ["gpuguard: XID79"]
        # (the worker stores the position it was handed after the failed attempt's records: wait, not race it)
        wait_for(lambda: w.cursor()["offset"] > before_xid, what="the cursor to move past the pending drain")
        assert slurm.drains() == []
        slurm.set("hang", on=False)
        wait_for(lambda: len(slurm.drains()) == 1, timeout=5, what="the retried drain")
        wait_for(lambda: w.cursor()["offset"] == log.stat().st_size, what="the cursor to move on")
        wait_for(lambda: [d["outcome"] for d in w.drain_rows()].count("already") == 1, what="the 2nd fatal")
    assert "XID79" in slurm.reason()  # the first fatal Xid names the drain
    outcomes = [d["outcome"] for d in reversed(w.drain_rows())]
    assert outcomes == ["failed", "done", "already"]
    assert any(r["findings"][0]["keyword"] == "XID13" for r in w.runs())


def test_once_judges_what_is_new_and_holds_the_cursor_when_slurm_is_down(tmp_path, slurm):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(kmsg_record(1, "NVRM: Xid (PCI:0000:86:00): 79, pid=<unknown>, name=<unknown>, off the bus"))
    slurm.set("fail")
    r = Running(tmp_path, slurm, f"kmsg:{kmsg}", once=True)
    assert r.daemon.run() == 1  # the drain did not happen
    # it stands as pending in the verdict journal, so the position moved past the Xid with it
    assert [p.reason[:15] for p in r.journal().pending] == ["gpuguard: XID79"] and r.cursor()["seq"] == 1
    slurm.set("fail", on=False)
    r2 = Running(tmp_path, slurm, f"kmsg:{kmsg}", once=True)
    assert r2.daemon.run() == 0
    assert len(slurm.drains()) == 1 and r2.cursor()["seq"] == 1
    r3 = Running(tmp_path, slurm, f"kmsg:{kmsg}", once=True)
    assert r3.daemon.run() == 0 and len(slurm.drains()) == 1


def test_the_watch_applies_a_drain_a_hook_could_not(tmp_path, slurm):
    """A prolog decided a drain while slurmctld was down (pending in the node's verdict journal): the watch daemon
    retries it like every later run does, and it is applied once (issue 14)."""
    from gpuguard.model import PendingDrain

    log = tmp_path / "kern.log"
    log.write_text("")
    r = Running(tmp_path, slurm, f"file:{log}")
    j = r.journal()
    j.add_pending(PendingDrain(id="p1", op="drain", reason="gpuguard: XID119 gpu.xid: GSP RPC Timeout [prolog reset]",
                               action="reset", check_id="gpu.xid", created=time.time() - 30, origin="prolog"))
    assert j.save() is None
    with r:
        wait_for(lambda: len(slurm.drains()) == 1, what="the hook's pending drain applied by the watch")
        wait_for(lambda: not r.journal().pending, what="the journal emptied")
    assert "XID119" in slurm.reason()
    assert [(d["outcome"], d["check_id"]) for d in r.drain_rows()] == [("done", "gpu.xid")]
    assert "decided by the prolog" in r.drain_rows()[0]["detail"]


def test_a_watch_drain_slurm_did_not_take_makes_the_prolog_refuse_jobs(tmp_path, slurm):
    """One pipeline: the watch saw the fatal Xid but slurmctld was down; the next prolog on the node (its own
    kernel-log position may be anywhere) refuses the job and applies the watch's drain first."""
    from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg, run_sim

    kmsg = tmp_path / "kmsg"
    kmsg.write_text(kmsg_record(1, "NVRM: Xid (PCI:0000:86:00): 79, pid=<unknown>, name=<unknown>, off the bus"))
    slurm.set("fail")
    assert Running(tmp_path, slurm, f"kmsg:{kmsg}", once=True).daemon.run() == 1
    memory = MemorySlurm()
    shared = {"runtime_dir": os.environ["GPUGUARD_RUNTIME_DIR"]}  # the node's one verdict journal
    prolog = run_sim(ctx("prolog", "n1"), make_cfg(tmp_path / "hook", store=shared),
                     str(SCENARIOS / "healthy-p5.yaml"), slurm_client=memory)
    assert prolog.exit_code == 1 and prolog.verdict.outcome == "pass"
    assert "XID79" in (memory.reason or "") and [a["outcome"] for a in prolog.applied] == ["done"]


def test_an_edit_of_the_config_file_is_followed_without_a_signal(tmp_path, slurm, monkeypatch):
    """A daemon started before the site made Xid 13 fatal (or set notify.urls) judged by the old config until
    someone sent SIGHUP, while every hook already used the new one. Now an edit is picked up once it has settled;
    a broken edit is refused once (not at every check) and the running config stays."""
    from gpuguard.watch import configfile

    monkeypatch.setattr(configfile, "CHECK_S", 0.2)
    log, cfg = tmp_path / "kern.log", tmp_path / "config.yaml"
    log.write_text("")
    gglog = tmp_path / "gpuguard.log"
    with Running(tmp_path, slurm, f"file:{log}", config_file=cfg):
        append(log, xid_line(13, "3b", "Graphics Exception"))
        time.sleep(0.5)
        assert slurm.drains() == []  # app-class Xid 13: not a node fault
        cfg.write_text(config_text(tmp_path, slurm, f"file:{log}", extra="xid: {overrides: {13: {severity: fatal}}}\n"))
        wait_for(lambda: "configuration reloaded" in gglog.read_text(), what="the reload")
        assert f"{cfg} changed" in gglog.read_text()
        append(log, xid_line(13, "86", "Graphics Exception"))
        wait_for(lambda: slurm.drains(), what="the drain after the reload")
        assert "XID13" in slurm.reason()
        cfg.write_text("deadlines: {scontrol_s: soon}\n")
        wait_for(lambda: "reload failed" in gglog.read_text(), what="the refused reload")
        time.sleep(1.0)  # five more checks of the unchanged broken file
        assert gglog.read_text().count("reload failed") == 1


def test_an_edit_is_taken_only_once_the_file_stopped_changing(tmp_path):
    from gpuguard.watch.configfile import ConfigFileWatch

    f = tmp_path / "config.yaml"
    f.write_text("a: 1\n")
    w = ConfigFileWatch(str(f), now=0.0, interval_s=1.0)
    assert not w.settled_change(1.0)  # unchanged
    f.write_text("a: 1\nb")  # an editor half-way through
    assert not w.settled_change(1.5)  # not due yet
    assert not w.settled_change(2.0)  # first sight of the new file
    f.write_text("a: 1\nb: 2\n")
    assert not w.settled_change(3.0)  # still changing
    assert w.settled_change(4.0)  # the same as at the last check: settled
    w.loading()  # the daemon reads it
    assert not w.settled_change(5.0) and not w.settled_change(6.0)
    f.unlink()  # a file that went away is a change too (the reload then fails and keeps the running config)
    assert not w.settled_change(7.0) and w.settled_change(8.0)


# --------------------------------------------------------------------------- the real command: signals, systemd


def test_cli_notifies_systemd_reloads_on_sighup_and_exits_0_on_sigterm(tmp_path, slurm):
    log = tmp_path / "kern.log"
    log.write_text("")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config_text(tmp_path, slurm, f"file:{log}"))
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(15)
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "PYTHONPATH": str(REPO / "lib")}
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "watch", "--config", str(cfg), "--node", "n1"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert sock.recv(4096).startswith(b"READY=1")
        append(log, xid_line(13, "3b", "Graphics Exception"))
        time.sleep(0.5)
        assert slurm.drains() == []  # app-class Xid 13: not a node fault
        # a site decides Xid 13 is fatal on its cluster; a reload picks it up without a restart
        cfg.write_text(config_text(tmp_path, slurm, f"file:{log}", extra="xid: {overrides: {13: {severity: fatal}}}\n"))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "configuration reloaded" in (tmp_path / "gpuguard.log").read_text(), what="the reload")
        append(log, xid_line(13, "86", "Graphics Exception"))
        wait_for(lambda: slurm.drains(), what="the drain after the reload")
        assert "XID13" in slurm.reason()
        cfg.write_text("deadlines: {scontrol_s: soon}\n")  # a broken config is refused, the watch goes on
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in (tmp_path / "gpuguard.log").read_text(), what="the refused reload")
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - t0 < 2.0
        assert b"STOPPING=1" in sock.recv(4096)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def _unit(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_shipped_systemd_unit_starts_the_daemon_from_the_installed_env(tmp_path, slurm):
    """Run the unit's ExecStart= the way systemd would, with the gpuguard.env `make install` writes."""
    import shlex

    from gpuguard.cli.install import install_hooks

    unit = _unit(REPO / "healthcheck" / "gpuguard-watch.service")
    assert unit["Type"] == ["notify"] and unit["Restart"] == ["always"]
    assert "PrivateDevices" not in unit and "ProtectKernelLogs" not in unit  # both would hide /dev/kmsg
    assert unit["DeviceAllow"] == ["/dev/kmsg r"]
    log = tmp_path / "kern.log"
    log.write_text("")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config_text(tmp_path, slurm, f"file:{log}"))
    libexec = tmp_path / "libexec"
    install_hooks(libexec, sys.executable, str(cfg))
    assert unit["EnvironmentFile"] == ["/usr/local/libexec/gpuguard/gpuguard.env"]
    env = {"PATH": "/usr/bin:/bin"}  # systemd's environment: nothing but the EnvironmentFile
    for line in (libexec / "gpuguard.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = shlex.split(value)[0]
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(15)
    env["NOTIFY_SOCKET"] = sock_path
    env.update(gpuguard_dirs())  # the test's own state and runtime directories, never the node's /run/gpuguard
    proc = subprocess.Popen(shlex.split(unit["ExecStart"][0]), env=env, stderr=subprocess.DEVNULL)
    try:
        assert sock.recv(4096).startswith(b"READY=1")
        append(log, xid_line(79))
        wait_for(lambda: slurm.drains(), what="a drain by the unit's daemon")
        proc.send_signal(signal.SIGTERM)  # what `systemctl stop` sends
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def test_a_hostile_node_name_is_refused_before_anything_runs(tmp_path, slurm):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config_text(tmp_path, slurm, f"file:{tmp_path}/kern.log"))
    p = subprocess.run([sys.executable, "-m", "gpuguard.watch.daemon", "--config", str(cfg), "--node", "../../etc/x"],
                       env={**os.environ, "PYTHONPATH": str(REPO / "lib")}, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "invalid node name '../../etc/x'" in p.stderr
    assert not (tmp_path / "etc").exists() and slurm.calls() == []


def test_sd_notify_without_systemd_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert sd_notify("READY=1") is False


def test_config_section_validates_with_line_numbers():
    from gpuguard.config.schema import ConfigError

    cfg = parse_config("watch:\n  dedupe_window_s: 60\n  start_at: end\n", "c.yaml")
    assert cfg.watch.dedupe_window_s == 60 and cfg.watch.poll_interval_s == 0.25
    with pytest.raises(ConfigError, match=r"c.yaml: line 2: watch.start_at: expected one of auto, boot, end"):
        parse_config("watch:\n  start_at: middle\n", "c.yaml")
    with pytest.raises(ConfigError, match=r"line 2: watch.dedup_window_s: unknown key \(did you mean"):
        parse_config("watch:\n  dedup_window_s: 3\n", "c.yaml")
