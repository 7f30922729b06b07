"""The suite never writes the host's kernel log (issue 30): a forged `NVRM: Xid` record in the real /dev/kmsg is seen
by every other health tool on a developer's GPU machine (NHC's check_cmd_dmesg, a DCGM or gpud agent) as a fault
that never happened. tests/conftest.py refuses an open of the device for writing in the test process; the sources of
tests/ and devtools/ are read here for the writes a subprocess or a shell line would do."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "devtools")
SUFFIXES = {".py", ".sh", ".bash", ".j2", ".yaml", ".yml", ".service"}
# this file opens the device for writing on purpose: to show that the guard refuses it
ON_PURPOSE = {Path(__file__).resolve()}

_WRITES = [
    # open("/dev/kmsg", "w"), io.open(..., "ab"), os.open("/dev/kmsg", os.O_WRONLY | ...), Path(...).open("a")
    re.compile(r"open\(\s*[^)]*?/dev/kmsg['\"][^)]*?(O_WRONLY|O_RDWR|['\"][rb]*[wax+][rwaxb+t]*['\"])", re.S),
    re.compile(r"/dev/kmsg['\"]\s*\)\s*\.\s*(open\(\s*['\"][rb]*[wax+]|write_(text|bytes)\()"),
    re.compile(r">>?\s*/dev/kmsg\b"),  # shell redirection
    re.compile(r"\btee\b[^\n|;]*/dev/kmsg\b"),
    re.compile(r"\blogger\b[^\n|;]*(--kmsg|-k\b)"),  # util-linux logger writing to the kernel log
]


def writes_to_kmsg(text: str) -> list[str]:
    """The spans of `text` that write to /dev/kmsg."""
    return [m.group(0) for rx in _WRITES for m in rx.finditer(text)]


def test_the_scanner_knows_a_write_from_a_read():
    assert writes_to_kmsg('w = os.open("/dev/kmsg", os.O_WRONLY)')
    assert writes_to_kmsg('fd = os.open(\n    "/dev/kmsg",\n    os.O_RDWR | os.O_NONBLOCK)')
    assert writes_to_kmsg('with open("/dev/kmsg", "w") as kmsg:')
    assert writes_to_kmsg("Path('/dev/kmsg').write_text(line)")
    assert writes_to_kmsg("echo '<0>NVRM: Xid 79' > /dev/kmsg")
    assert writes_to_kmsg("printf x | tee -a /dev/kmsg")
    assert not writes_to_kmsg('fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)')
    assert not writes_to_kmsg('make_follower("kmsg:/dev/kmsg", cursor=None)')
    assert not writes_to_kmsg("open('/dev/kmsg', 'rb')")
    assert not writes_to_kmsg('"systemd-journald[{n}]: /dev/kmsg buffer overrun, some messages lost."')


def test_no_test_or_dev_tool_writes_the_hosts_kernel_log():
    found = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix not in SUFFIXES or path.resolve() in ON_PURPOSE or "__pycache__" in path.parts:
                continue
            text = path.read_text(errors="replace")
            found += [f"{path.relative_to(REPO)}: {span!r}" for span in writes_to_kmsg(text)]
    assert not found, "writes to the host's kernel log (use a kernel-log source of the test's own):\n" + "\n".join(found)


@pytest.mark.parametrize("how", ["open w", "open a", "Path.open", "os.open wronly", "os.open rdwr", "a symlink"])
def test_opening_the_host_kernel_log_for_writing_raises_in_a_test(how, tmp_path):
    """The runtime guard of tests/conftest.py, by every name: nothing is opened, so nothing can be written (and
    nothing is written here even without the guard: an open alone, closed at once)."""
    kmsg = "/dev/kmsg"
    link = tmp_path / "kmsg-link"
    link.symlink_to(kmsg)
    opens = {
        "open w": lambda: open(kmsg, "w"),
        "open a": lambda: open(kmsg, "ab"),
        "Path.open": lambda: Path(kmsg).open("w"),
        "os.open wronly": lambda: os.open(kmsg, os.O_WRONLY),
        "os.open rdwr": lambda: os.open(kmsg, os.O_RDWR | os.O_NONBLOCK),
        "a symlink": lambda: open(link, "w"),
    }
    with pytest.raises(PermissionError, match="opened the host's kernel log"):
        opened = opens[how]()
        os.close(opened) if isinstance(opened, int) else opened.close()


def test_reading_the_host_kernel_log_is_still_allowed(tmp_path):
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg not readable here")
    os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    own = tmp_path / "kmsg"
    with open(own, "w") as f:  # a kmsg-format file of the test's own is an ordinary file
        f.write("4,1,100,-;hello\n")
    assert own.read_text() == "4,1,100,-;hello\n"
