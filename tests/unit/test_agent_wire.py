"""The node agent's pieces that need no agent process: the wire format (hostile environments stay data), the
confinement test (a sandboxed unit refuses to host it), the hook client against scripted agents that hang, refuse,
die or stop answering (it always ends within its bounds, and runs the hook itself rather than fail it), and what the
hooks' hot path imports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from gpuguard.agent import client, wire
from gpuguard.agent.confinement import cgroup_v2_path, issues_from, parse_status
from gpuguard.agent.adopt import mismatch
from gpuguard.agent.stamp import CodeWatch, code_stamp, first_change, is_stdlib, package_files
from gpuguard.cli.hooks import HookUsageError, parse_hook_args


def _request(**over: object) -> wire.HookRequest:
    fields: dict[str, object] = dict(
        kind="prolog", args=["prolog"], env={b"SLURM_JOB_ID": b"42", b"PATH": b"/bin"}, cwd="/", umask=0o022,
        nice=0, oom_score_adj=None, rlimits={8: (65536, 65536), 7: (1024, 524288), 4: (0, -1)}, started=12.5, executable=sys.executable,
        package=os.path.dirname(os.path.abspath(sys.modules["gpuguard"].__file__ or "")),
        runtime=wire.runtime_signature(), fds="012")
    fields.update(over)
    return wire.HookRequest(**fields)  # type: ignore[arg-type]


def _decode(data: bytes) -> wire.HookRequest:
    header, _, body = data.partition(b"\n")
    return wire.decode_request(body[:wire.body_length(header)])


# --------------------------------------------------------------------------- the wire format


def test_a_request_round_trips_with_a_hostile_environment():
    env = {b"SLURM_JOB_COMMENT": b"$(reboot); `id` \xff\xfe not utf-8", b"X": b"a=b=c", b"EMPTY": b"",
           b"SLURM_JOB_GPUS": b"0,1,../../etc"}
    req = _request(env=env, args=["prolog", "--config", "/etc/gg.yaml"], nice=-5, oom_score_adj=-1000)
    back = _decode(wire.encode_request(req))
    assert back.env == env  # byte for byte: the child validates it exactly as the hook process would
    assert (back.kind, back.args, back.nice, back.oom_score_adj, back.started) == \
        ("prolog", ["prolog", "--config", "/etc/gg.yaml"], -5, -1000, 12.5)
    assert back.rlimits == {8: (65536, 65536), 7: (1024, 524288), 4: (0, -1)}
    assert _decode(wire.encode_request(_request(streams="utf-8:surrogateescape|utf-8:backslashreplace"))).streams \
        == "utf-8:surrogateescape|utf-8:backslashreplace"


@pytest.mark.parametrize("mangle", [
    lambda d: d.replace(wire.MAGIC, b"gpuguard-hook/9", 1),  # another protocol
    lambda d: d[:-1],  # truncated
    lambda d: d.replace(b"\nprolog\0", b"\nrm -rf\0", 1),  # not a hook kind
])
def test_a_malformed_request_is_refused(mangle: Callable[[bytes], bytes]):
    with pytest.raises(wire.WireError):
        _decode(mangle(wire.encode_request(_request())))


@pytest.mark.parametrize("over", [dict(cwd="relative/dir"), dict(nice=-40), dict(umask=0o7777), dict(fds="0012")])
def test_impossible_process_settings_are_refused(over: dict[str, object]):
    with pytest.raises(wire.WireError):
        _decode(wire.encode_request(_request(**over)))


def test_an_oversized_request_is_refused_not_truncated():
    big = {b"BLOB": b"x" * (wire.MAX_REQUEST_BYTES + 1)}
    with pytest.raises(wire.WireError):
        wire.encode_request(_request(env=big))
    with pytest.raises(wire.WireError):
        wire.body_length(wire.MAGIC + b" " + str(wire.MAX_REQUEST_BYTES + 1).encode())


def test_the_agent_refuses_requests_its_code_would_not_run_alike():
    assert mismatch(_request()) is None
    assert mismatch(_request(executable="/usr/bin/python3.9")) == "another Python"
    assert mismatch(_request(package="/opt/other/gpuguard")) == "another gpuguard installation"
    assert mismatch(_request(runtime="3.11|latin-1|...")).startswith("another interpreter setup (the hook's '3.11|")


def test_the_child_encodes_its_streams_as_the_hook_process_would():
    """Seen on a real H200 machine (bench/real_gpu.py): the agent, started with a locale, refused hooks started with
    slurmd's bare environment ("another interpreter setup": stdout's errors strict there, surrogateescape here), so
    every prolog paid for the agent's refusal and then its own start-up. How the hook's stdout and stderr encode
    text is no reason to refuse: the child takes the settings over."""
    assert mismatch(_request(streams="utf-8:strict|utf-8:strict")) is None
    code = ("import sys; from gpuguard.agent.adopt import adopt_streams; adopt_streams(sys.argv[1]); "
            "print(sys.stdout.encoding, sys.stdout.errors, sys.stderr.encoding, sys.stderr.errors)")
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "lib"), "LC_ALL": "C.UTF-8"}
    p = subprocess.run([sys.executable, "-c", code, "latin-1:surrogateescape|ascii:replace"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.stdout.split() == ["latin-1", "surrogateescape", "ascii", "replace"], p.stderr
    p = subprocess.run([sys.executable, "-c", code, "no-such-codec:strict|utf-8:strict"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert "LookupError" in p.stderr  # serve_request refuses: the hook runs in its own process


def test_the_code_stamp_changes_when_a_loaded_file_changes(tmp_path: Path):
    f = tmp_path / "mod.py"
    f.write_text("x = 1\n")
    before = code_stamp([str(f)])
    assert code_stamp([str(f)]) == before
    f.write_text("x = 22\n")  # an upgrade: the agent must not run requests with the code it loaded
    assert code_stamp([str(f)]) != before
    f.unlink()
    assert code_stamp([str(f)]) != before


def test_the_code_stamp_covers_a_venvs_site_packages_and_the_whole_package(tmp_path: Path):
    """Issue 27: inside a venv sysconfig's platstdlib is the venv's lib/pythonX.Y, the parent of site-packages, and
    the stamp left out every installed package: after `make install` hooks ran old code through the agent."""
    lib = str(tmp_path / "venv" / "lib" / "python3.11")
    stdlib = (os.path.join("/usr/lib/python3.11", ""), os.path.join(lib, ""))
    assert is_stdlib("/usr/lib/python3.11/json/decoder.py", stdlib)
    assert is_stdlib(f"{lib}/lib-dynload/_json.so", stdlib)
    assert not is_stdlib(f"{lib}/site-packages/gpuguard/cli/hooks.py", stdlib)
    assert not is_stdlib(f"{lib}/site-packages/pynvml.py", stdlib)
    assert not is_stdlib("/usr/lib/python3/dist-packages/yaml/__init__.py", stdlib)
    import pynvml  # noqa: F401 - from the venv this test runs in

    files = CodeWatch().files()
    assert os.path.abspath(sys.modules["pynvml"].__file__ or "") in files
    here = Path(sys.modules["gpuguard"].__path__[0])
    # modules a hook imports only on some paths, and data files, are covered whether loaded or not
    assert {str(here / "cli" / "hooks.py"), str(here / "profiles" / "p5.48xlarge.yaml")} <= set(package_files())
    assert not [f for f in files if "__pycache__" in f]


def test_the_code_stamp_names_what_changed(tmp_path: Path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 1\n")
    before = code_stamp([str(a), str(b)])
    b.write_text("y = 2\n")
    assert first_change(before, code_stamp([str(a), str(b)])) == str(b)
    c = tmp_path / "c.py"
    c.write_text("y = 1\n")  # a file replaced (a new version's): another inode, even with the same size and times
    os.utime(c, ns=(before[1][1][2], before[1][1][2]))
    os.replace(c, b)
    assert first_change(before, code_stamp([str(a), str(b)])) == str(b)


# --------------------------------------------------------------------------- confinement


SANDBOXED = """Name:\tpython3\nNoNewPrivs:\t1\nCapBnd:\t0000000400000000\n"""
FREE = """Name:\tpython3\nNoNewPrivs:\t0\nCapBnd:\t000001ffffffffff\n"""


def _files(status: str, memory_max: str = "max", cgroup: str = "0::/system.slice/gpuguard-watch.service\n"):
    files = {"/proc/self/status": status, "/proc/1/status": FREE, "/proc/self/cgroup": cgroup,
             "/sys/fs/cgroup/system.slice/gpuguard-watch.service/memory.max": memory_max + "\n",
             "/sys/fs/cgroup/system.slice/gpuguard-watch.service/pids.max": "max\n"}
    return lambda path: files.get(path)


def test_the_hardened_watch_unit_may_not_host_the_agent():
    issues = issues_from(_files(SANDBOXED, memory_max="268435456"), same_mount_ns=False, euid=0)
    assert any("mount namespace" in i for i in issues)
    assert any("NoNewPrivileges" in i for i in issues)
    assert any("capability bounding set" in i for i in issues)
    assert any("memory.max" in i for i in issues)


def test_an_unconfined_root_process_may_host_the_agent():
    assert issues_from(_files(FREE), same_mount_ns=True, euid=0) == []
    assert issues_from(_files(FREE), same_mount_ns=None, euid=0) == []  # PID 1 unreadable (a container)
    assert issues_from(_files(FREE), same_mount_ns=True, euid=1000) == ["runs as uid 1000, the hooks run as root"]


def test_proc_parsers():
    assert parse_status("CapBnd:\t000001ffffffffff\nbad line\n") == {"CapBnd": "000001ffffffffff"}
    assert cgroup_v2_path("12:memory:/x\n0::/system.slice/a.service\n") == "/system.slice/a.service"
    assert cgroup_v2_path("4:memory:/x\n") is None


def test_hook_arguments_without_argparse():
    assert parse_hook_args(["prolog"]) == ("prolog", None, None)
    assert parse_hook_args(["epilog", "--config", "/c.yaml", "--simulate=/s.yaml"]) == ("epilog", "/c.yaml", "/s.yaml")
    for bad in ([], ["check"], ["prolog", "--config"], ["prolog", "--bogus", "1"]):
        with pytest.raises(HookUsageError):
            parse_hook_args(bad)


# --------------------------------------------------------------------------- the client against scripted agents


class ScriptedAgent:
    """A listening socket whose answers a test scripts: what a hung, refusing, dying or stopped agent looks like. Its
    "child" is a sleeping process (the client kills it when it stops waiting for it)."""

    def __init__(self, directory: Path, script: Callable[[socket.socket, int], None], accept: bool = True,
                 hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr, dirfd = wire.address(wire.socket_path(str(directory)))
        self.sock.bind(addr)
        if dirfd is not None:
            os.close(dirfd)
        self.sock.listen(8)
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.got: list[bytes] = []
        self.fds_received = 0
        if accept:
            threading.Thread(target=self._serve, args=(script, hello), daemon=True).start()

    def _serve(self, script: Callable[[socket.socket, int], None], hello: bool) -> None:
        try:
            conn, _ = self.sock.accept()
            with conn:
                if hello:
                    conn.sendall(f"hello {self.child.pid}\n".encode())
                    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                    self.fds_received = len(fds)
                    for fd in fds:
                        os.close(fd)
                    self.got.append(data)
                script(conn, self.child.pid)
        except OSError:
            pass  # the client went its own way, or the test closed the socket

    def killed(self) -> bool:
        try:
            return self.child.wait(5) == -9
        except subprocess.TimeoutExpired:
            return False

    def close(self) -> None:
        self.sock.close()
        if self.child.poll() is None:
            self.child.kill()
            self.child.wait()


LAST_WHY: list[str] = []  # why the last _ask fell back ("" when the agent answered)


def _ask(directory: Path, ack_timeout_s: float = 0.3) -> tuple[Optional[int], float]:
    t0 = time.monotonic()
    code, why = client.run_through_agent(["prolog"], t0, directory=str(directory), ack_timeout_s=ack_timeout_s)
    LAST_WHY[:] = [why]
    return code, time.monotonic() - t0


def test_no_agent_means_run_in_process_at_once(tmp_path: Path):
    assert _ask(tmp_path)[0] is None and LAST_WHY == [client.NO_AGENT]  # no socket: not a fallback
    (tmp_path / wire.SOCKET_NAME).write_text("not a socket")
    code, took = _ask(tmp_path)
    assert code is None and took < 0.2 and LAST_WHY == [client.NO_AGENT]


def test_a_child_that_hangs_before_taking_the_request_costs_the_ack_timeout_and_is_killed(tmp_path: Path):
    agent = ScriptedAgent(tmp_path, lambda conn, pid: time.sleep(5))  # took the request, never says ready
    try:
        code, took = _ask(tmp_path, ack_timeout_s=0.3)
        assert code is None  # run in-process, and the result line will say why (issue 30: fallbacks are seen)
        assert LAST_WHY == ["agent child ended before taking the hook"] or LAST_WHY[0].startswith("agent"), LAST_WHY
        assert took < 1.5
        assert agent.got and agent.got[0].startswith(wire.MAGIC) and agent.fds_received == 3
        assert agent.killed()  # it holds the hook's stdout/stderr: it must not keep them (or act) later
    finally:
        agent.close()


def test_an_agent_that_never_accepts_gets_neither_the_request_nor_the_hooks_streams(tmp_path: Path):
    agent = ScriptedAgent(tmp_path, lambda conn, pid: None, accept=False)  # stopped (SIGSTOP): the kernel queues us
    try:
        code, took = _ask(tmp_path, ack_timeout_s=0.3)
        conn, _ = agent.sock.accept()  # resumed: what the client left in the queue
        with conn:
            conn.settimeout(1)
            assert conn.recv(1 << 16) == b""  # nothing: no request, no file descriptors held for the hook
    finally:
        agent.close()
    assert code is None and took < 1.5


def test_a_refusing_agent_means_run_in_process(tmp_path: Path):
    agent = ScriptedAgent(tmp_path, lambda conn, pid: conn.sendall(b"refused code changed\n"), hello=False)
    try:
        assert _ask(tmp_path)[0] is None
    finally:
        agent.close()


def test_the_agents_exit_code_is_the_hooks(tmp_path: Path):
    def run(conn: socket.socket, pid: int) -> None:
        conn.sendall(f"ready {pid}\n".encode())
        assert conn.recv(16) == b"go\n"
        conn.sendall(b"code 1 30\ncode 0 30\nexit 0\n")

    agent = ScriptedAgent(tmp_path, run)
    try:
        assert _ask(tmp_path)[0] == 0
        assert agent.child.poll() is None  # a child that answered is never signalled
    finally:
        agent.close()


def test_a_child_that_dies_early_means_run_in_process(tmp_path: Path):
    def run(conn: socket.socket, pid: int) -> None:
        conn.sendall(f"ready {pid}\n".encode())
        conn.recv(16)
        conn.sendall(b"code 1 30\n")  # then killed (OOM, a bug): EOF

    agent = ScriptedAgent(tmp_path, run)
    try:
        assert _ask(tmp_path)[0] is None  # 30 s left: the hook runs again, here
    finally:
        agent.close()


@pytest.mark.parametrize("verdict", [True, False])
def test_a_child_that_stops_answering_is_killed_at_the_hooks_deadline(tmp_path: Path, verdict: bool):
    done = threading.Event()

    def run(conn: socket.socket, pid: int) -> None:
        conn.sendall(f"ready {pid}\n".encode())
        conn.recv(16)
        conn.sendall(b"code 1 0.5\n")  # the hook's deadline is 0.5 s and it would exit 1 now
        if verdict:
            conn.sendall(b"verdict 1\n")  # ... because its run judged the node (a drain)
        done.wait(10)  # SIGSTOPped: never another word

    agent = ScriptedAgent(tmp_path, run)
    try:
        code, took = _ask(tmp_path)
        done.set()
        # its verdict stands; without one (the policy's code), the hook runs again in its own process
        assert code == (1 if verdict else None)
        assert 0.5 + client.WATCHDOG_GRACE_S - 0.1 < took < 0.5 + client.WATCHDOG_GRACE_S + 2.0
        assert agent.killed()  # it must not act after the client gave up on it
    finally:
        agent.close()


@pytest.mark.parametrize("verdict", [True, False])
def test_a_child_lost_at_the_deadline_leaves_its_verdict_or_a_run_here(tmp_path: Path, verdict: bool):
    """Issue 27: lost (the agent unit restarted, an OOM kill) with less than a second left. A verdict stands; a run
    with none (NVML had not answered) is never an exit 0: the hook runs again here, where a hung NVML drains."""

    def run(conn: socket.socket, pid: int) -> None:
        conn.sendall(f"ready {pid}\n".encode())
        conn.recv(16)
        conn.sendall(b"code 0 0.1\n" + (b"verdict 1\n" if verdict else b""))  # open policy: 0 until judged
        time.sleep(client.WATCHDOG_GRACE_S - 0.5)  # then killed: EOF with under MIN_FALLBACK_S left

    agent = ScriptedAgent(tmp_path, run)
    try:
        assert _ask(tmp_path)[0] == (1 if verdict else None)
    finally:
        agent.close()


def test_only_an_agent_running_as_this_user_may_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    agent = ScriptedAgent(tmp_path, lambda conn, pid: conn.sendall(f"ready {pid}\n".encode()))
    monkeypatch.setattr(client, "peer_uid", lambda sock: os.geteuid() + 1)
    try:
        assert _ask(tmp_path)[0] is None
        assert not any(agent.got)  # nothing was sent to it
    finally:
        agent.close()


# --------------------------------------------------------------------------- what the hot path imports


def _modules_after(code: str) -> set[str]:
    p = subprocess.run([sys.executable, "-I", "-c", code + "\nimport sys; print('\\n'.join(sorted(sys.modules)))"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return set(p.stdout.split())


def test_the_hook_client_imports_nothing_of_the_pipeline():
    mods = _modules_after("import gpuguard.agent.client")
    assert not {m for m in mods if m.startswith("gpuguard.") and not m.startswith("gpuguard.agent")
                and m not in ("gpuguard.util", "gpuguard.util.nodedirs")}
    assert not mods & {"pynvml", "sqlite3", "yaml", "json", "typing", "socket", "argparse", "re"}


def test_a_hook_run_in_its_own_process_keeps_the_garbage_collector_for_what_it_allocates(tmp_path: Path):
    """The fallback imports the hook path with the collector off, then freezes what it imported: the hook itself
    runs with the collector on, and cyclic garbage it makes is still collected."""
    code = ("import gc, sys\nfrom gpuguard.agent.client import main\nrc = main(['--help'])\n"
            "class Cycle:\n    pass\nc = Cycle(); c.me = c; del c\n"
            "print(rc, 'gpuguard.cli.hooks' in sys.modules, gc.isenabled(), gc.get_freeze_count() > 1000, "
            "gc.collect() >= 1)")
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                       env={"GPUGUARD_STATE_DIR": str(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-5:] == ["0", "True", "True", "True", "True"], p.stdout


def test_the_in_process_hook_imports_no_yaml_argparse_dataclasses_or_notifications():
    mods = _modules_after("import gpuguard.cli.hooks")
    assert not mods & {"yaml", "argparse", "psycopg", "apprise", "prometheus_client", "uuid", "traceback", "jinja2",
                        "difflib", "dataclasses", "inspect",  # plain data is a @record (gpuguard.util.record)
                        "pathlib"}  # ~13M instructions (urllib.parse, ipaddress...): os.path
    features = {m for m in mods if m.startswith(("gpuguard.notify", "gpuguard.fleet.ship", "gpuguard.metrics",
                                                 "gpuguard.watch", "gpuguard.templates", "gpuguard.nccl.sweep"))}
    # only each feature's config section (gpuguard.<feature>.config: one dataclass), loaded with the config
    assert features <= {f"gpuguard.{p}{m}" for p in ("notify", "metrics", "watch", "templates") for m in ("", ".config")}


# --------------------------------------------------------------------------- a busy agent is not a hung one (issue 30)

# An agent in a process of its own: it listens, keeps its CPU busy for BUSY seconds (an agent forking children for
# the hooks queued before ours on a loaded node), then serves one hook with exit code 0. BUSY < 0: busy for ever.
BUSY_AGENT = r"""
import os, socket, sys, time
sys.path[:0] = [{lib!r}]
from gpuguard.agent import wire
busy = float(sys.argv[1])
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
addr, dirfd = wire.address(wire.socket_path(sys.argv[2]))
sock.bind(addr)
sock.listen(8)
print("listening", flush=True)
t0 = time.monotonic()
while busy < 0 or time.monotonic() - t0 < busy:
    pass
conn, _ = sock.accept()
conn.sendall(f"hello {{os.getpid()}}\n".encode())
data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
conn.sendall(f"ready {{os.getpid()}}\n".encode())
assert conn.recv(16) == b"go\n"
conn.sendall(b"code 1 30\nverdict 0\nexit 0\n")
time.sleep(1)
"""


def _busy_agent(directory: Path, busy_s: float) -> subprocess.Popen[str]:
    lib = str(Path(client.__file__).resolve().parents[2])
    p = subprocess.Popen([sys.executable, "-c", BUSY_AGENT.format(lib=lib), str(busy_s), str(directory)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "listening\n"
    return p


def test_a_busy_agent_is_waited_for_not_left_behind(tmp_path: Path):
    """Under a burst the agent forks a child for each hook queued before ours while every process waits for a CPU:
    it runs (or waits to), it is not hung. With the flat 0.5 s bound of before, 182 of 200 prologs of a burst fell
    back to their own processes, each paying a whole interpreter start-up more."""
    agent = _busy_agent(tmp_path, 1.5)
    try:
        code, took = _ask(tmp_path, ack_timeout_s=0.3)
        assert code == 0 and LAST_WHY == [""], LAST_WHY  # served by the agent, not run here
        assert 1.0 < took < client.PATIENCE_S
    finally:
        agent.kill()
        agent.wait()


def test_an_agent_busy_past_the_patience_is_left_behind_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(client, "PATIENCE_S", 1.0)
    agent = _busy_agent(tmp_path, -1)  # spinning for ever (a bug, or a node so loaded that 5 s pass)
    try:
        code, took = _ask(tmp_path, ack_timeout_s=0.3)
        assert code is None and took < 3.0
        assert LAST_WHY[0].startswith("agent did not start a child within") and LAST_WHY[0].endswith("(busy)"), LAST_WHY
    finally:
        agent.kill()
        agent.wait()


def test_a_stopped_agent_is_left_behind_after_the_ack_timeout(tmp_path: Path):
    agent = _busy_agent(tmp_path, 60)
    os.kill(agent.pid, signal.SIGSTOP)  # hung: it neither runs nor waits for a CPU
    try:
        code, took = _ask(tmp_path, ack_timeout_s=0.3)
        assert code is None and took < 1.5
        assert LAST_WHY[0].startswith("agent did not start a child within") and LAST_WHY[0].endswith("(idle)"), LAST_WHY
    finally:
        agent.kill()
        agent.wait()


def test_the_busy_measure_reads_the_scheduler():
    me = client.schedstat_ns(os.getpid())
    assert me is not None and me > 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.05:
        pass
    assert client.schedstat_ns(os.getpid()) - me >= 0.04e9  # type: ignore[operator]
    assert client.schedstat_ns(1 << 30) is None  # no such process
