#!/usr/bin/env python3
"""Kernel-log Xid scan vs `grep -c 'NVRM: Xid'`, whole processes, on a generated mixed kern.log.

    python bench/kernel_log_scan.py [--size-mb 1024] [--dir DIR] [--keep] [--repeat 5] [--uniform]

The log is syslog-format (what rsyslog writes to kern.log): mostly ordinary kernel lines of varied subsystems
(runtime messages common, boot-time ones rare, as in a real long-running log), other NVRM lines, a few hundred
real-shaped Xid lines and some `logger`-forged Xid lines (tag `user`, which the scanner must reject).

Measured, with a warm page cache, `--repeat` pairs taken in turn (grep, scan, scan, grep, ...), each figure the
median with its spread (bench/figures.py) and the load average before and after:
- `grep -c 'NVRM: Xid' FILE` and `gpuguard xid scan --file FILE --json`, each a whole process (interpreter start-up
  and imports included): the scan's events, forged lines and verdict are checked against what was generated;
- the hooks' reads (FileSource, in process): the first read of the whole file, a re-read of the unchanged file
  from its cursor, and the read of 1 MiB appended after the cursor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT))  # devtools/

sys.path.insert(0, str(ROOT / "bench"))

from figures import Measuring, Table, ratio_spread, spread  # noqa: E402

from gpuguard.kernellog.file import FileSource  # noqa: E402

_HOST = "gpu-node-017"
_MONTHS = ["Nov"]

# ordinary kernel messages (shapes from real dmesg output), {n} and {h} filled in randomly. The first group
# repeats all the time on a busy node; the second is printed about once per boot or mount, so in a large
# kern.log it is much rarer (see --uniform for a log where every shape is equally common).
_CHATTY = [
    "usb 1-{n}: new high-speed USB device number {n} using xhci_hcd",
    "EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
    "mlx5_core 0000:{h}:00.0: mlx5_port_module_event:1136:(pid 0): Port module event: module {n}, Cable plugged",
    "mlx5_core 0000:{h}:00.1 ens{n}f1np1: Link up",
    "IPv6: ADDRCONF(NETDEV_CHANGE): cali{h}{h}{h}: link becomes ready",
    "audit: type=1400 audit({n}.{n}:{n}): apparmor=\"STATUS\" operation=\"profile_load\" name=\"snap.{n}\"",
    "TCP: request_sock_TCP: Possible SYN flooding on port {n}. Sending cookies.",
    "pcieport 0000:{h}:01.0: AER: Corrected error received: 0000:{h}:00.0",
    "perf: interrupt took too long ({n} > {n}), lowering kernel.perf_event_max_sample_rate to {n}",
    "systemd-journald[{n}]: /dev/kmsg buffer overrun, some messages lost.",
    "br-{h}{h}: port {n}(veth{h}{h}) entered forwarding state",
    "NVRM: GPU at PCI:0000:{h}:00: GPU-{h}{h}{h}{h}-{h}{h}-{h}{h}",
    "NVRM: GPU Board Serial Number: 16504230{n}",
    "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping further processing",
    "INFO: task python:{n} blocked for more than 120 seconds.",
    "Out of memory: Killed process {n} (python3) total-vm:{n}kB, anon-rss:{n}kB",
    "python3[{n}]: segfault at 0 ip 00007f{h}{h}{h}{h} sp 00007ff{h}{h}{h} error 4 in libc.so.6[7f{h}{h}+{h}000]",
]
_BOOT = [
    "nvme nvme{n}: 32/0/0 default/read/poll queues",
    "EDAC skx MC{n}: HANDLING MCE MEMORY ERROR",
    "efa 0000:{h}:00.0: Setup irq:{n} name:efa-mgmnt@pci:0000:{h}:00.0",
    "XFS (md{n}): Ending clean mount",
    "x86/cpu: SGX disabled by BIOS.",
    "nvidia-nvswitch{n}: open (major={n})",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024",
    "NVRM: GPU 0000:{h}:00.0: RmInitAdapter failed! (0x24:0x72:1568)",
]
_BOOT_SHARE = 0.02  # share of lines from boot-time shapes
_XIDS = [
    "NVRM: Xid (PCI:0000:{h}:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:{h}:00): 13, pid={n}, name=python, Graphics SM Warp Exception on (GPC 1, TPC 0, SM 0): "
    "Illegal Instruction Encoding",
    "NVRM: Xid (PCI:0000:{h}:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) "
    "has been detected on GPU in the framebuffer at physAddr 0x7fffa8860 partition 7, subpartition 1.",
    "NVRM: Xid (PCI:0000:{h}:00): 63, pid={n}, name=pt_main_thread, Row Remapper: New row marked for remapping, "
    "reset gpu to activate.",
    "NVRM: Xid (PCI:0000:{h}:00): 119, pid={n}, name=python, Timeout after 45s of waiting for RPC response from "
    "GPU4 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801702 0x4).",
]


def _fill(template: str, rng: random.Random) -> str:
    out = template
    while "{n}" in out:
        out = out.replace("{n}", str(rng.randrange(1, 99999)), 1)
    while "{h}" in out:
        out = out.replace("{h}", f"{rng.randrange(256):02x}", 1)
    return out


def _syslog(msg: str, rng: random.Random, tag: str = "kernel", mono: bool = True) -> str:
    stamp = f"Nov {rng.randrange(1, 29):2d} {rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"
    inner = f"[{rng.randrange(1, 9_999_999):7d}.{rng.randrange(1_000_000):06d}] " if mono else ""
    return f"{stamp} {_HOST} {tag}: {inner}{msg}\n"


def _block(rng: random.Random, size: int, uniform: bool) -> bytes:
    lines = []
    total = 0
    every = _CHATTY + _BOOT
    while total < size:
        if uniform:
            template = rng.choice(every)
        else:
            template = rng.choice(_BOOT if rng.random() < _BOOT_SHARE else _CHATTY)
        line = _syslog(_fill(template, rng), rng)
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()


def generate(path: Path, size_mb: int, *, uniform: bool = False, seed: int = 7) -> tuple[int, int]:
    """Write the log; returns (kernel Xid lines, forged Xid lines)."""
    rng = random.Random(seed)
    block_size = 8 << 20
    blocks = [_block(rng, block_size, uniform) for _ in range(4)]
    target = size_mb << 20
    n_blocks = max(1, target // block_size)
    xids_per_block = max(1, 300 // n_blocks) if n_blocks < 300 else 1
    n_xid = n_forged = 0
    with open(path, "wb") as f:
        for i in range(n_blocks):
            block = blocks[i % len(blocks)]
            cut = block.index(b"\n", rng.randrange(len(block) // 2)) + 1
            extra = []
            for _ in range(xids_per_block):
                extra.append(_syslog(_fill(rng.choice(_XIDS), rng), rng))
                n_xid += 1
            if i % 8 == 0:  # `logger -t user "NVRM: Xid ..."` run by a user
                extra.append(_syslog(_fill(rng.choice(_XIDS), rng), rng, tag="user", mono=False))
                n_forged += 1
            f.write(block[:cut])
            f.write("".join(extra).encode())
            f.write(block[cut:])
    return n_xid, n_forged


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def _scan_command() -> list[str]:
    """`gpuguard` as an admin runs it: the console script beside this interpreter, else `python -m gpuguard`."""
    script = Path(sys.executable).with_name("gpuguard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuguard"]


def whole_processes(path: Path, repeat: int) -> tuple[list[float], list[float], Any, Any]:
    """Wall times of grep and of `gpuguard xid scan`, alternating, and the last output of each."""
    grep = [shutil.which("grep") or "grep", "-c", "NVRM: Xid", str(path)]
    scan = _scan_command() + ["xid", "scan", "--file", str(path), "--json"]
    # as installed: bytecode compiled (a first run writes it, also where the caller's environment said not to)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(ROOT / "lib")}
    t_grep, t_scan = [], []
    g = subprocess.run(grep, capture_output=True, check=False)
    p = subprocess.run(scan, capture_output=True, check=False, env=env)
    for i in range(repeat):  # pairs, in turn: grep first in one round, the scan first in the next
        for which in (("grep", "scan") if i % 2 == 0 else ("scan", "grep")):
            if which == "grep":
                dt, g = _timed(lambda: subprocess.run(grep, capture_output=True, check=False))
                t_grep.append(dt)
            else:
                dt, p = _timed(lambda: subprocess.run(scan, capture_output=True, check=False, env=env))
                t_scan.append(dt)
    return t_grep, t_scan, g, p


def hook_reads(path: Path, repeat: int) -> dict[str, float]:
    """The hooks' FileSource: first read, unchanged re-read, and 1 MiB appended (restored afterwards)."""
    src = FileSource(str(path))
    t_first, first = _timed(lambda: src.read(None, timeout_s=600))
    assert first.status.complete and first.lines_scanned > 0
    t_rescan = min(_timed(lambda: src.read(first.cursor, timeout_s=600))[0] for _ in range(repeat))
    again = src.read(first.cursor, timeout_s=600)
    assert not again.events and again.lines_scanned == 0
    size = path.stat().st_size
    rng = random.Random(11)
    block = _block(rng, 1 << 20, False) + _syslog(_fill(_XIDS[0], rng), rng).encode()
    try:
        with open(path, "ab") as f:
            f.write(block)
        t_incr, new = _timed(lambda: src.read(first.cursor, timeout_s=600))
        assert [e.code for e in new.events] == [79], new.events
    finally:
        os.truncate(path, size)
    return {"first": t_first, "rescan": t_rescan, "incremental": t_incr}


def measure(path: Path, repeat: int, n_xid: int, n_forged: int) -> tuple[list[float], list[float], dict[str, float]]:
    """grep's and the scan's wall times (checked against what was generated) and the hooks' reads."""
    with open(path, "rb") as f:  # warm the page cache so both tools read from memory
        while f.read(16 << 20):
            pass
    t_grep, t_scan, g, p = whole_processes(path, repeat)
    _check_scan(p, g, n_xid, n_forged)
    return t_grep, t_scan, hook_reads(path, repeat)


def bench_scan(table: Table, size_mb: int, repeat: int, key: str, target: float = 0.5) -> None:
    """bench/run.py's part: the log generated in a temporary directory, the rows in `table`."""
    print(f"[3] kernel-log Xid scan of a generated {size_mb} MiB kern.log, {repeat} pairs in turn: "
          "`gpuguard xid scan --file` vs `grep -c`", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpuguard-bench-"))
    try:
        path = workdir / "kern.log"
        n_xid, n_forged = generate(path, size_mb)
        with Measuring() as load:
            t_grep, t_scan, hooks = measure(path, repeat, n_xid, n_forged)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    r, r_text = ratio_spread(t_scan, t_grep)
    table.row(f"{key} ({size_mb} MiB, whole process)", spread(t_scan), f"<= {target:g}x grep", r <= target,
              yardstick=f"grep -c 'NVRM: Xid': {spread(t_grep)}", ratio=r_text, load=load, key=True)
    table.row("hooks: re-read of the unchanged log from its cursor (best)", f"{hooks['rescan'] * 1000:.1f} ms",
              "<= 50 ms", hooks["rescan"] <= 0.05, load=load)
    table.row("hooks: read of 1 MiB appended after the cursor", f"{hooks['incremental'] * 1000:.1f} ms", "<= 50 ms",
              hooks["incremental"] <= 0.05, load=load)
    table.row(f"hooks: first read of the whole {size_mb} MiB file (lines counted)", f"{hooks['first']:.2f} s", "-",
              None, load=load)


def _check_scan(p: Any, g: Any, n_xid: int, n_forged: int) -> dict[str, Any]:
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])  # fatal Xids in the log: the verdict drains
    out = json.loads(p.stdout)
    assert len(out["events"]) == n_xid, (len(out["events"]), n_xid)
    assert out["rejected_non_kernel"] == n_forged and out["malformed"] == 0, out
    assert out["verdict"]["outcome"] == "drain"
    assert int(g.stdout.strip() or 0) == n_xid + n_forged, (g.stdout, n_xid, n_forged)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="where to write the log (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the generated log")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--uniform", action="store_true",
                    help="every message shape equally common (boot-time shapes too: a harder, less realistic log)")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gpuguard-bench-", dir=args.dir))
    path = workdir / "kern.log"
    try:
        t0 = time.perf_counter()
        n_xid, n_forged = generate(path, args.size_mb, uniform=args.uniform)
        size = path.stat().st_size
        print(f"generated {size / 2**30:.2f} GiB ({n_xid} Xid lines, {n_forged} forged) in "
              f"{time.perf_counter() - t0:.1f} s: {path}; {len(os.sched_getaffinity(0))} CPUs")
        with Measuring():
            t_grep, t_scan, hooks = measure(path, args.repeat, n_xid, n_forged)
        _print_table(size, t_grep, t_scan, hooks)
    finally:
        if args.keep:
            print(f"kept {path}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _print_table(size: int, t_grep: list[float], t_scan: list[float], hooks: dict[str, float]) -> None:
    gb = size / 1e9
    bg, bs = min(t_grep), min(t_scan)
    print()
    print(f"| {'what (wall time, best of runs; median)':52} | {'time (s)':>9} | {'median':>7} | {'GB/s':>6} |")
    print(f"|{'-' * 54}|{'-' * 11}|{'-' * 9}|{'-' * 8}|")
    print(f"| {'grep -c NVRM: Xid (whole process)':52} | {bg:9.3f} | {statistics.median(t_grep):7.3f} | "
          f"{gb / bg:6.2f} |")
    print(f"| {'gpuguard xid scan --file --json (whole process)':52} | {bs:9.3f} | "
          f"{statistics.median(t_scan):7.3f} | {gb / bs:6.2f} |")
    print(f"| {'hooks: FileSource first read (lines counted)':52} | {hooks['first']:9.3f} | {'':>7} | "
          f"{gb / hooks['first']:6.2f} |")
    print(f"| {'hooks: FileSource re-read, file unchanged':52} | {hooks['rescan']:9.4f} | {'':>7} | {'':>6} |")
    print(f"| {'hooks: FileSource read of 1 MiB appended':52} | {hooks['incremental']:9.4f} | {'':>7} | {'':>6} |")
    print()
    print(f"xid scan / grep wall time: {bs / bg:.2f} (best), {ratio_spread(t_scan, t_grep)[1]} (median [p10-p90 of "
          f"the pairs]); target <= 0.5x\ngrep {spread(t_grep)}, scan {spread(t_scan)}")


if __name__ == "__main__":
    raise SystemExit(main())
