"""NHC (LBNL Node Health Check, github.com/mej/nhc) as the prolog's yardstick: its own `nhc` script, from the checkout
NHC_SRC names (tag 1.4.3), running 7 host checks the way a site runs it as a Slurm prolog or HealthCheckProgram:
no resource manager calls, no log file, no detached mode. Nothing of NHC is copied into gpuguard; the config is
written to a temporary directory and the checks use NHC's own scripts from the checkout.

    git clone https://github.com/mej/nhc && git -C nhc checkout 1.4.3
    NHC_SRC=$PWD/nhc make bench
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

CHECKS = 7


def cpu_counts(cpuinfo: str) -> tuple[int, int, int]:
    """(sockets, cores, threads) as NHC 1.4.3 counts them from /proc/cpuinfo (a VM without `physical id` lines
    counts each processor as a socket with one core and one thread)."""
    processors, sockets, cores, siblings = 0, set(), None, None
    for line in cpuinfo.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "processor":
            processors += 1
        elif key == "physical id":
            sockets.add(value)
        elif key == "cpu cores":
            cores = int(value)
        elif key == "siblings":
            siblings = int(value)
    if processors and not sockets:
        return processors, processors, processors
    if sockets and cores:
        n = len(sockets)
        return n, n * cores, n * siblings if siblings else n * cores
    return 1, 1, 1


def config_text() -> str:
    """Seven checks that hold on any healthy Linux host: the root file system mounted read-write with space left,
    PID 1 running as root, the CPU count NHC itself reads, some memory, swap within bounds, a readable file."""
    sockets, cores, threads = cpu_counts(Path("/proc/cpuinfo").read_text())
    init = Path("/proc/1/comm").read_text().strip() or "init"
    checks = ["check_fs_mount_rw -f /", "check_fs_free / 1%", f"check_ps_service -u root {init}",
              f"check_hw_cpuinfo {sockets} {cores} {threads}", "check_hw_physmem 1kb 100tb", "check_hw_swap 0kb 100tb",
              "check_file_test -r /etc/passwd"]
    assert len(checks) == CHECKS
    return "".join(f"* || {c}\n" for c in checks)


def nhc_command(src: str, workdir: Path) -> list[str]:
    """The command line that runs NHC's 7 checks from the checkout `src`."""
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nhc.conf"
    conf.write_text(config_text())
    return [str(Path(src) / "nhc"), "-D", str(workdir), "-c", str(conf), "-l", "-", "-t", "30",
            f"INCDIR={Path(src) / 'scripts'}", "ONLINE_NODE=:", "OFFLINE_NODE=:", "MARK_OFFLINE=0", "DETACHED_MODE=0"]


def find_nhc(workdir: Path) -> tuple[Optional[list[str]], str]:
    """(command, description) when NHC_SRC names a usable checkout, else (None, why not)."""
    src = os.environ.get("NHC_SRC")
    if not src:
        return None, "NHC not measured: set NHC_SRC to a checkout of github.com/mej/nhc at tag 1.4.3"
    if not (Path(src) / "nhc").is_file() or not (Path(src) / "scripts").is_dir():
        return None, f"NHC not measured: {src} is not an NHC checkout (no nhc script and scripts/)"
    if shutil.which("bash") is None:
        return None, "NHC not measured: it needs bash"
    cmd = nhc_command(src, workdir)
    p = subprocess.run(cmd, env={}, capture_output=True, text=True, cwd="/", timeout=60)
    if p.returncode != 0:
        return None, f"NHC not measured: its {CHECKS} checks fail on this host: {(p.stdout + p.stderr).strip()[-300:]}"
    version = subprocess.run(["git", "-C", src, "describe", "--tags"], capture_output=True, text=True).stdout.strip()
    return cmd, f"NHC {version or '(version unknown)'}, {CHECKS} host checks"
