#!/usr/bin/env python3
"""`gpuguard watch` on a real local Slurm cluster: Xid-to-drain latency, flood cost, idle CPU and memory.

1. latency: N times, append an Xid 79 kernel record to node1's (simulated) kernel log and time until (a) the drain
   went through (the store's drain row, written when `scontrol update` returned) and (b) an admin's `scontrol show
   node` shows DRAIN (polled every 10 ms, so it includes up to one poll of slack); then lift it as an admin does
   after the repair (`gpuguard undrain node1 --force`: the Xid 79 stands as a condition of the node until then, and
   a plain resume would be drained again) and, interleaved, time the yardstick: a bare `scontrol update
   state=drain` (then resumed). Targets: p50 <= 1 s (issue 3), p95 reported.
2. flood: 100k Xid 13 records at once; CPU per line and whether anything was drained (target: nothing).
3. idle: CPU% and RSS of the daemon over `--idle-s` seconds with nothing happening, following the simulated
   node's kmsg *file* (polled every watch.poll_interval_s: the worst case) and, where readable, the real
   /dev/kmsg (woken by the kernel only). Targets: < 1% of one core, < 50 MB RSS.

    python bench/watch_latency.py [--samples 15] [--idle-s 30] [--flood 100000]

bench/run.py calls `bench_watch(samples, idle_s, row=row)`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT))  # devtools/

sys.path.insert(0, str(ROOT / "bench"))

from devtools.devsite import DevSite  # noqa: E402
from figures import Measuring, Table, pct, ratio_spread, spread  # noqa: E402

XID79 = "NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID13 = "NVRM: Xid (PCI:0000:{bus}:00): 13, pid={pid}, name=python3, Graphics SM Warp Exception on (GPC 1, TPC 0)"

Row = Callable[..., None]  # (what, value, target, ok, yardstick="-", ratio=None), as bench/run.py's row


def _print_row(what: str, value: str, target: str, ok: Optional[bool], yardstick: str = "-",
               ratio: Optional[float | str] = None, load: Any = None) -> None:
    verdict = "-" if ok is None else ("ok" if ok else "MISSED")
    r = "" if ratio is None else (ratio if isinstance(ratio, str) else f"{ratio:.2f}x")
    beside = "" if yardstick == "-" else f" | {yardstick}" + (f" | {r}" if r else "")
    print(f"  {what}: {value}{beside} (target {target}) {verdict}", flush=True)


def scontrol_drain_once(cluster: Any, node: str) -> float:
    """The floor of any drain: a bare `scontrol update NodeName=X State=DRAIN Reason=...` round trip on the same
    cluster (then resumed: an admin's own drain, no gpuguard condition behind it)."""
    t0 = time.monotonic()
    p = cluster.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=bench yardstick"])
    took = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"scontrol drain failed: {p.stderr.strip()}")
    resume_if_drained(cluster, node)
    return took


def resume_if_drained(cluster: Any, node: str) -> None:
    """`scontrol update state=resume`, only for a node that is drained or down: Slurm answers "Invalid node state
    specified" for any other."""
    if cluster.node_flags(node) & {"DRAIN", "DRAINED", "DRAINING", "DOWN"}:
        cluster.resume(node)


def lift_condition(site: DevSite, node: str) -> None:
    """What an admin does after the repair of a fatal Xid: `gpuguard undrain NODE --force` (recorded): it clears the
    standing condition and lifts gpuguard's drain. A plain `scontrol update state=resume` is not enough since node
    conditions: the watch daemon drains such a node again within watch.agree_s."""
    if "DRAIN" not in site.cluster.node_flags(node):
        return
    u = site.gpuguard("undrain", node, "--force")
    if u.returncode != 0:
        raise SystemExit(f"gpuguard undrain {node} --force failed ({u.returncode}): {(u.stdout + u.stderr)[-800:]}")
    site.cluster.wait_nodes(lambda flags: "DRAIN" not in flags, nodes=[node], timeout=15)


def _drain_row(site: DevSite, node: str, after: int, timeout: float = 10.0) -> dict[str, Any]:
    """The store's newest drain row once there are more than `after`: the daemon writes it when `scontrol update`
    returned, which may be a moment after an admin already sees DRAIN."""
    end = time.monotonic() + timeout
    while True:
        with site.store(node) as st:
            rows = st.drains(node)
        if len(rows) > after:
            return rows[0]
        if time.monotonic() > end:
            raise SystemExit(f"no drain row within {timeout:g} s: {rows[:1]}")
        time.sleep(0.02)


class _Daemon:
    def __init__(self, site: DevSite, node: str, *extra: str) -> None:
        self.sock_path = str(site.workdir / f"notify-{node}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.sock.settimeout(30)
        env = {**site.cluster.env, "NOTIFY_SOCKET": self.sock_path}
        self.proc = subprocess.Popen([site.python, "-m", "gpuguard", "watch", "--config", str(site.config_path),
                                      "--node", node, *extra], env=env, stderr=subprocess.DEVNULL)
        if not self.sock.recv(4096).startswith(b"READY=1"):
            raise SystemExit("watch did not report READY")

    def stop(self) -> int:
        self.proc.terminate()
        rc = self.proc.wait(15)
        self.sock.close()
        return rc


class _Kmsg:
    """Appends kernel records to a simulated node's kmsg file, numbering them on from the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seq = 0
        for line in path.read_text().splitlines():
            m = re.match(r"\d+,(\d+),", line)
            if m:
                self.seq = int(m.group(1))

    def append(self, texts: list[str]) -> None:
        out = []
        for t in texts:
            self.seq += 1
            out.append(f"4,{self.seq},{1_000_000 * (300 + self.seq)},-;{t}\n")
        with open(self.path, "a") as f:
            f.write("".join(out))


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _idle(pid: int, seconds: float) -> tuple[float, float]:
    """(CPU % of one core, RSS MiB) over `seconds` of nothing happening."""
    import psutil

    c0, t0 = _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    c1, t1 = _cpu_s(pid), time.monotonic()
    return (c1 - c0) / (t1 - t0) * 100, psutil.Process(pid).memory_info().rss / 2**20


def _latency_samples(site: DevSite, kmsg: "_Kmsg", samples: int) -> dict[str, list[float]]:
    """Xid 79 -> drain, `samples` times, each followed by the yardstick (a bare scontrol drain) on the same node:
    the pair interleaved."""
    cluster = site.cluster
    out: dict[str, list[float]] = {"done": [], "seen": [], "floor": []}
    for i in range(samples):
        lift_condition(site, "node1")
        n_before = len(site.store("node1").drains("node1"))
        # past the dedupe window, at a random phase of the file poll (a real Xid does not wait for it)
        time.sleep(0.6 + random.uniform(0, 0.25))
        t_wall, t0 = time.time(), time.monotonic()
        kmsg.append([XID79])
        while "DRAIN" not in cluster.node_flags("node1"):
            if time.monotonic() - t0 > 10:
                raise SystemExit(f"sample {i}: node1 not drained within 10 s")
            time.sleep(0.01)
        out["seen"].append(time.monotonic() - t0)
        row = _drain_row(site, "node1", n_before)
        if row["outcome"] != "done":
            raise SystemExit(f"sample {i}: drain row {row}")
        out["done"].append(row["ts"] - t_wall)
        lift_condition(site, "node1")
        out["floor"].append(scontrol_drain_once(cluster, "node1"))
    return out


def _flood(site: DevSite, daemon: "_Daemon", kmsg: "_Kmsg", flood: int) -> tuple[float, int]:
    """(CPU microseconds per line, drains) for `flood` Xid 13 records appended at once."""
    drains_before = len(site.store("node1").drains("node1"))
    c0 = _cpu_s(daemon.proc.pid)
    kmsg.append([XID13.format(bus=f"{0x10 + i % 8:02x}", pid=1000 + i % 64) for i in range(flood)])
    size = kmsg.path.stat().st_size
    t0 = time.monotonic()
    while True:  # the cursor reaches the end of the file once every line was judged
        with site.store("node1") as st:
            cur = st.get_cursor("watch:node1") or {}
        if cur.get("offset") == size:
            break
        if time.monotonic() - t0 > 120:
            raise SystemExit("flood not judged within 120 s")
        time.sleep(0.1)
    us = (_cpu_s(daemon.proc.pid) - c0) / flood * 1e6
    return us, len(site.store("node1").drains("node1")) - drains_before


def _idle_rows(site: DevSite, daemon: "_Daemon", idle_s: float, row: Row) -> None:
    others: list[tuple[str, _Daemon]] = []
    if os.access("/dev/kmsg", os.R_OK):
        # a second daemon reading the real kernel log (never writing it), under a node name Slurm does not know
        others.append(("/dev/kmsg", _Daemon(site, "bench-kmsg", "--source", "kmsg:/dev/kmsg")))
    time.sleep(2.0)  # let start-up settle
    with Measuring() as load:
        cpu, rss = _idle(daemon.proc.pid, idle_s)
    row(f"watch idle CPU, simulated kmsg file polled every 0.25 s ({idle_s:g} s)", f"{cpu:.2f} %", "< 1 %",
        cpu < 1.0, load=load)
    row("watch idle RSS", f"{rss:.1f} MB", "< 50 MB", rss < 50)
    for name, other in others:
        ocpu, orss = _idle(other.proc.pid, min(idle_s, 10.0))
        row(f"watch idle CPU / RSS following {name}", f"{ocpu:.2f} % / {orss:.1f} MB", "< 1 % / < 50 MB",
            ocpu < 1.0 and orss < 50, load=load)
        other.stop()


def bench_watch(samples: int = 15, idle_s: float = 30.0, flood: int = 100_000, row: Row = _print_row) -> None:
    print(f"[watch] Xid-to-drain latency ({samples} samples, each beside a bare scontrol drain), Xid 13 flood "
          f"({flood} lines), idle cost ({idle_s:g} s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="gg-bench-watch-") as d:
        # dedupe window below the time between samples: every sample's Xid 79 is a new event
        with DevSite(nodes=1, workdir=Path(d) / "site", config={"watch": {"dedupe_window_s": 0.5}}) as site:
            daemon = _Daemon(site, "node1")
            kmsg = _Kmsg(site.workdir / "sim" / "node1" / "kmsg")
            with Measuring() as load:
                lat = _latency_samples(site, kmsg, samples)
            yard = f"bare scontrol drain: {spread(lat['floor'])}"
            p50 = statistics.median(lat["done"])
            row("watch: Xid -> drain done", spread(lat["done"]), "p50 <= 1 s", p50 <= 1.0, yardstick=yard,
                ratio=ratio_spread(lat["done"], lat["floor"])[1], load=load)
            row("watch: Xid -> drain done, p95", f"{pct(lat['done'], 95):.3f} s", "-", None, load=load)
            row("watch: Xid -> DRAIN seen by scontrol (polled every 10 ms)", spread(lat["seen"]), "-", None, load=load)
            lift_condition(site, "node1")
            with Measuring() as load:
                us, drained = _flood(site, daemon, kmsg, flood)
            row(f"watch: Xid 13 flood of {flood} lines, CPU per line / drains", f"{us:.1f} us / {drained}",
                "0 drains", drained == 0, load=load)
            _idle_rows(site, daemon, idle_s, row)
            rc = daemon.stop()
            row("watch exit code on SIGTERM", str(rc), "0", rc == 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--flood", type=int, default=100_000)
    a = ap.parse_args()
    table = Table()
    bench_watch(a.samples, a.idle_s, a.flood, row=table.row)
    table.print()
    return 1 if table.missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
