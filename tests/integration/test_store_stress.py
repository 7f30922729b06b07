"""One node's history store under everything that uses it at once (issue 27, item 8), for a bounded time.

The installed hooks run as slurmd runs them (prolog and health check, through `DevSite`'s hook scripts, in loops),
the watch daemon (its store open the whole time), `gpuguard status` and the notification hand-off process run beside
them, the config flips between valid and invalid every ~3 s, the node's GPU breaks (Xid 48 and its ECC counter: the
watch and the hooks drain and page) and is repaired (a reboot, the admin's resume, the undrain), and processes are
killed with SIGKILL at random points (whatever still runs at the end too). Pages go to a real local webhook server.

At the end the store is still the same file (nothing was moved aside as damaged), `PRAGMA integrity_check` (through
SQLite only) says ok, and every drain page the store spooled reached the webhook exactly once (a second copy is
accepted only when a SIGKILL landed right after the first one arrived: the killed process could not record that it
was sent).

With `ensure_trusted_state` opening the database file outside SQLite (closing that descriptor dropped the locks of
the process's live connections; another process then deleted the -wal/-shm under them) this failed every time: the
store malformed and moved aside, or the watch daemon's drain page never sent (its write was lost).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from devtools.devsite import DevSite
from gpuguard.util.fs import atomic_write

pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")

STRESS_S = 20.0  # the whole test stays under ~40 s on CI's 2 cores
TIMEOUT_S = 2.0  # notify.timeout_s
SETTLE_S = 25.0  # at most, for a message a killed process had claimed to be retried (usually at once)
NODE = "node1"


class Timed(list):
    """The webhook server's request list, with when each request arrived (time.monotonic())."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def append(self, item: Any) -> None:
        self.times.append(time.monotonic())
        super().append(item)


class Procs:
    """The children the test started (each in a session of its own), so that the killer can pick one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}
        self.kills: list[tuple[float, str]] = []
        self.started = 0
        self.crashed: list[str] = []  # what a process not killed said with a traceback

    def run(self, name: str, argv: list[str], env: dict[str, str], timeout: float = 60) -> Optional[int]:
        p = subprocess.Popen(argv, env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        with self.lock:
            self.live[p.pid] = (name, p)
            self.started += 1
        try:
            _out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _out, err = p.communicate()
        finally:
            with self.lock:
                self.live.pop(p.pid, None)
        if "Traceback" in err and p.returncode != -signal.SIGKILL:
            self.crashed.append(f"{name}: {err[-1500:]}")
        return p.returncode

    def kill_one(self, rng: random.Random) -> None:
        with self.lock:
            if self.live:
                self._kill(rng.choice(sorted(self.live)))

    def kill_all(self) -> None:
        """The end of the stress: whatever still runs is killed too (the test's time stays bounded on a busy CI)."""
        with self.lock:
            for pid in sorted(self.live):
                self._kill(pid)

    def _kill(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills.append((time.monotonic(), self.live[pid][0]))


def loop(until: float, body: Callable[[int], Any]) -> threading.Thread:
    def run() -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            body(i)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def hook_argv(site: DevSite, kind: str) -> list[str]:
    return site.cluster.command([str(site.libexec / f"gpuguard-{kind}")])


def gpuguard_env(site: DevSite) -> dict[str, str]:
    return {**os.environ, "GPUGUARD_CONFIG": str(site.config_path), "GPUGUARD_STATE_DIR": str(site.workdir / "state"),
            "GPUGUARD_RUNTIME_DIR": str(site.workdir / "run"), **site.cluster.env}


XID48 = ("NVRM: Xid (PCI:0000:a8:00): 48, pid=25812, name=python3, An uncorrectable double bit error (DBE) has been "
         "detected on GPU in the framebuffer at partition 4, subpartition 1.")


def append_kernel(site: DevSite, text: str) -> None:
    """A kernel record the way the driver logs it, on the node's simulated /dev/kmsg (its sequence number well past
    the scenario's own, which the hooks append as they run)."""
    kmsg = site.workdir / "sim" / NODE / "kmsg"
    last = max([int(m.group(1)) for m in re.finditer(r"^\d+,(\d+),", kmsg.read_text(), re.M)] or [0])
    with open(kmsg, "a") as f:
        f.write(f"4,{last + 100},{1_000_000 * (200 + last)},-;{text}\n")


def drain_cycles(site: DevSite, until: float) -> None:
    """The GPU breaks (an uncorrectable ECC error: Xid 48 in the kernel log, which the watch daemon sees first,
    and NVML's volatile DBE counter: the hooks and the watch drain the node and page), then the node is rebooted
    and the admin resumes it: the health check lifts gpuguard's drain."""
    cycle = 0
    while time.monotonic() < until:
        boot = f"stress-boot-{cycle}"
        append_kernel(site, XID48)
        site.write_scenario(NODE, "ecc-dbe", boot_id=boot)
        _wait(lambda: "DRAIN" in site.cluster.node_flags(NODE), until)
        time.sleep(1.0)
        cycle += 1
        site.write_scenario(NODE, "healthy-p5", boot_id=f"stress-boot-{cycle}")
        site.cluster.run(["scontrol", "update", f"NodeName={NODE}", "State=RESUME"])
        _wait(lambda: "DRAIN" not in site.cluster.node_flags(NODE), until)
        time.sleep(1.0)


def _wait(cond: Callable[[], bool], until: float) -> None:
    while time.monotonic() < until and not cond():
        time.sleep(0.2)


def integrity(db: Path) -> list[Any]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as e:
        return [(f"{type(e).__name__}: {e}",)]
    finally:
        conn.close()


def spooled(db: Path, kind: str) -> list[tuple[str, str, str]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("SELECT title, body, status FROM notify_spool WHERE kind=? ORDER BY id",
                            (kind,)).fetchall()
    finally:
        conn.close()


@pytest.mark.slow(40)
def test_one_nodes_store_stays_sound_under_concurrent_use_and_kills(site_factory, watch_factory, hook):
    hook.requests = Timed()
    site = site_factory(nodes=1, config={"notify": {"urls": [hook.url("/pages")], "rate_limit": 1000,
                                                                 "timeout_s": TIMEOUT_S}})
    state = site.workdir / "state"
    db = state / f"{NODE}.db"
    assert site.run_hook("healthcheck", NODE).returncode == 0  # the config is the last good one, the store exists
    watch_factory(site, NODE)  # the watch daemon keeps its store open for the whole test
    good = site.config_path.read_text()
    bad = good + "\ndeadlines_typo: 1\n"
    rng = random.Random(os.getpid())
    procs = Procs()
    until = time.monotonic() + STRESS_S
    env = gpuguard_env(site)

    def healthcheck(i: int) -> None:
        procs.run("healthcheck", hook_argv(site, "healthcheck"), site.hook_env(NODE, "healthcheck"))

    def prolog(i: int) -> None:
        job_env = {"SLURM_JOB_ID": str(1000 + i), "SLURM_JOB_GPUS": "0,1", "SLURM_JOB_USER": "root",
                   "SLURM_JOB_UID": "0"}
        procs.run("prolog", hook_argv(site, "prolog"), site.hook_env(NODE, "prolog", **job_env))

    def status(i: int) -> None:
        procs.run("status", site.cluster.command([site.python, "-m", "gpuguard", "status", "--details"]), env)

    def handoff(i: int) -> None:
        procs.run("handoff", [site.python, "-I", "-m", "gpuguard.notify.handoff", "--node", NODE, "--config",
                              str(site.config_path)], env)
        time.sleep(0.5)

    def flip(i: int) -> None:
        atomic_write(site.config_path, bad if i % 2 else good)
        time.sleep(3.0)

    def killer(i: int) -> None:
        time.sleep(rng.uniform(0.5, 2.5))
        procs.kill_one(rng)

    threads = [loop(until, f) for f in (healthcheck, prolog, status, handoff, flip, killer)]
    threads.append(threading.Thread(target=drain_cycles, args=(site, until), daemon=True))
    threads[-1].start()
    time.sleep(max(0.0, until - time.monotonic()))
    while any(t.is_alive() for t in threads[:-1]):
        procs.kill_all()
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=STRESS_S + 90)
    assert not any(t.is_alive() for t in threads)

    # Quiet again: a valid config, a healthy GPU; health checks deliver what is still spooled (a message a killed
    # process was delivering is retried once its claim ends).
    atomic_write(site.config_path, good)
    site.set_scenario(NODE, "healthy-p5")
    settle = time.monotonic() + SETTLE_S
    while True:
        site.run_hook("healthcheck", NODE)
        try:
            if time.monotonic() > settle or not [r for r in spooled(db, "drain") if r[2] == "pending"]:
                break
        except sqlite3.DatabaseError:
            break  # damaged: said below
        time.sleep(1.0)
    time.sleep(2.0)  # hand-off processes the hooks started (sessions of their own) finish

    aside = sorted(p.name for p in state.iterdir() if ".corrupt-" in p.name)
    assert not aside, f"the store was found damaged and moved aside: {aside}; {site.log_lines('was damaged')}"
    assert integrity(db) == [("ok",)]

    drains = spooled(db, "drain")
    assert drains, f"no drain was paged ({procs.started} processes, {len(procs.kills)} killed)"
    assert all(s == "sent" for _t, _b, s in drains), [(t, s) for t, _b, s in drains]
    for title, body, _s in drains:
        times = [t for r, t in zip(hook.requests, hook.requests.times)
                 if r["body"].get("title") == title and r["body"].get("message") == body]
        assert times, f"drain page never arrived: {title}"
        explained = any(0 <= k - times[0] <= 1.0 for k, _ in procs.kills)  # killed before it could mark it sent
        assert len(times) == 1 or explained, f"{title} arrived {len(times)} times"
    assert procs.kills, "nothing was killed"
    assert not procs.crashed, procs.crashed[:3]
