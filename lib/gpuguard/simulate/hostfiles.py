"""The simulated node's other files from a scenario: the kernel log (kmsg format, only ever appended to, like a
real one), the EFA/InfiniBand sysfs tree and an `fi_info` stub, and the system's /sys and /proc entries."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from gpuguard.simulate.spec import Scenario, ScenarioError
from gpuguard.simulate.sysfs import write_fake_infiniband


_FACILITY = {"kern": 0, "user": 1, "daemon": 3, "syslog": 5}


def _kmsg_entries(sc: Scenario) -> list[tuple[int, str]]:
    """(priority, text) for each scenario kernel line; `{text, facility}` forms forge non-kernel lines."""
    out = []
    for item in sc.data.get("kernel_log") or []:
        if isinstance(item, str):
            out.append((4, item))
        elif isinstance(item, dict) and "text" in item:
            fac = _FACILITY.get(item.get("facility", "kern"), 1)
            out.append((fac * 8 + int(item.get("level", 4)), str(item["text"])))
        else:
            raise ScenarioError(f"{sc.path}: kernel_log entries are strings or {{text, facility}}")
    return out


def sync_kmsg(workdir: Path, sc: Scenario, boot_id: str) -> Path:
    """Append scenario lines not yet in the node's fake kmsg: like a real kernel log, it only grows
    (until the boot id changes), so cursors behave as on a real node."""
    kmsg = workdir / "kmsg"
    state_path = workdir / "kmsg.state.json"
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("boot_id") != boot_id or not kmsg.exists():
        state = {"boot_id": boot_id, "next_seq": 1, "written": []}
        kmsg.write_text("")
    written = set(state["written"])
    new = []
    for idx, (pri, text) in enumerate(_kmsg_entries(sc)):
        key = hashlib.sha1(f"{idx}\0{text}".encode()).hexdigest()[:16]
        if key in written:
            continue
        seq = state["next_seq"]
        state["next_seq"] += 1
        clean = re.sub(r"[\x00-\x1f]", " ", text)
        new.append(f"{pri},{seq},{1_000_000 * (100 + seq)},-;{clean}\n")
        written.add(key)
        state["written"].append(key)
    if new:
        with kmsg.open("a") as f:
            f.writelines(new)
    state_path.write_text(json.dumps(state))
    return kmsg


# --------------------------------------------------------------------------- fabric and system


def _fi_info_output(devices: list[str]) -> str:
    blocks = []
    for dev in devices:
        for suffix, ep in (("rdm", "FI_EP_RDM"), ("dgrm", "FI_EP_DGRAM")):
            blocks.append(f"provider: efa\n    fabric: efa\n    domain: {dev}-{suffix}\n    version: 122.0\n"
                          f"    type: {ep}\n    protocol: FI_PROTO_EFA\n")
    return "".join(blocks)


def write_fabric(root: Path, sc: Scenario) -> None:
    fab = sc.data.get("fabric") or {}
    efa = fab.get("efa") or {}
    ib = fab.get("ib") or {}
    efa_count = int(efa.get("count", sc.profile.efa_devices or 0))
    ib_count = int(ib.get("count", sc.profile.ib_devices or 0))
    efa_down = set(efa.get("down") or [])
    ib_down = set(ib.get("down") or [])
    devices: list[dict[str, Any]] = []
    for i in range(efa_count):
        devices.append({"name": f"rdmap{16 + i}s27", "kind": "efa", "ports": [{
            "port": 1, "state": "DOWN" if i in efa_down else "ACTIVE",
            "phys_state": "Disabled" if i in efa_down else "LinkUp", "rate": "100 Gb/sec (4X EDR)",
            "link_layer": "Unspecified"}]})
    rate = f"{sc.profile.ib_rate_gbps or 400} Gb/sec (4X NDR)"
    for i in range(ib_count):
        devices.append({"name": f"mlx5_{i}", "kind": "ib", "ports": [{
            "port": 1, "state": "DOWN" if i in ib_down else "ACTIVE",
            "phys_state": "Polling" if i in ib_down else "LinkUp", "rate": rate, "link_layer": "InfiniBand"}]})
    write_fake_infiniband(root / "sys", devices)
    fi = fab.get("fi_info") or {}
    bindir = root / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    out = bindir / "fi_info.out"
    if fi.get("error"):
        out.write_text("fi_getinfo: -61 (No data available)\n")
        rc = 61
    else:
        n = int(fi.get("devices", efa_count))
        out.write_text(_fi_info_output([f"rdmap{16 + i}s27" for i in range(n)]))
        rc = 0
    hang = int(fi.get("hang_s", 0))
    stub = bindir / "fi_info"
    stub.write_text("#!/bin/sh\n# gpuguard simulation: prints a recorded `fi_info -p efa` output\n"
                    + (f"sleep {hang}\n" if hang else "")
                    + (f"exec cat '{out}'\n" if rc == 0 else f"cat '{out}'\nexit {rc}\n"))
    stub.chmod(0o755)


def write_system(root: Path, sc: Scenario) -> None:
    s = sc.data.get("system") or {}
    # the loaded nvidia module (created once: a new directory = a driver reload, see read_driver_fingerprint)
    (root / "sys/module/nvidia").mkdir(parents=True, exist_ok=True)
    cpus = int(s.get("cpus", sc.profile.cpus or os.cpu_count() or 1))
    cpu_dir = root / "sys/devices/system/cpu"
    cpu_dir.mkdir(parents=True, exist_ok=True)
    (cpu_dir / "online").write_text(f"0-{cpus - 1}\n" if cpus > 1 else "0\n")
    (cpu_dir / "offline").write_text(f"{s.get('offline', '')}\n")
    smt = str(s.get("smt", "on"))  # on | off | notsupported (an EC2 instance launched with one thread per core)
    (cpu_dir / "smt").mkdir(exist_ok=True)
    (cpu_dir / "smt" / "control").write_text(f"{smt}\n")
    (cpu_dir / "smt" / "active").write_text("1\n" if smt == "on" else "0\n")
    total_kib = int(float(s.get("memory_gib", sc.profile.memory_gib or 64)) * 1024 * 1024)
    avail_kib = int(float(s.get("mem_available_gib", total_kib / 1024 / 1024 * 0.95)) * 1024 * 1024)
    proc = root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {total_kib} kB\nMemFree:        {avail_kib} kB\nMemAvailable:   {avail_kib} kB\n"
        f"Buffers:        0 kB\nCached:         0 kB\nSwapCached:     0 kB\nActive:         0 kB\n"
        f"Inactive:       0 kB\nShmem:          0 kB\nSlab:           0 kB\nSReclaimable:   0 kB\n"
        f"SwapTotal:      0 kB\nSwapFree:       0 kB\n")
