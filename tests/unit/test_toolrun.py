"""The shared tool runner: argv only, hard timeout that kills the tool's whole process group."""

import os
import time

from gpuguard.util.toolrun import run_tool


def test_output_and_exit_code():
    r = run_tool(["sh", "-c", "echo out; echo err >&2; exit 3"], 5)
    assert (r.rc, r.text(), r.last_stderr_line(), r.ok) == (3, "out\n", "err", False)


def test_missing_binary():
    r = run_tool(["/nonexistent/fi_info", "-p", "efa"], 5)
    assert r.rc is None and r.error == "fi_info not found"


def test_timeout_kills_the_whole_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    # a wrapper whose child keeps the pipes open: killing only the wrapper would hang the caller
    t0 = time.monotonic()
    r = run_tool(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], 0.5)
    assert r.timed_out and "timed out after 0.5s" in r.error
    assert time.monotonic() - t0 < 3
    pid = int(pidfile.read_text())
    time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"


def test_arguments_are_never_a_shell():
    r = run_tool(["printf", "%s", "$(id) `id`; rm -rf /"], 5)
    assert r.text() == "$(id) `id`; rm -rf /"
