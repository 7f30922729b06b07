"""EFA hardware counters from sysfs and their deltas between runs.

The efa driver exposes per-port counters in ``/sys/class/infiniband/<dev>/ports/<port>/hw_counters/<name>``
(names as in the kernel's efa_com_cmd.h stats structs and prometheus/procfs' AmazonEfaCounters): tx/rx
bytes and packets, ``rx_drops``, send/recv and RDMA read/write work requests and bytes with
``rdma_read_wr_err`` / ``rdma_write_wr_err``, and on Nitro v4+ the SRD network stats ``retrans_bytes``,
``retrans_pkts``, ``retrans_timeout_events``, ``unresponsive_remote_events``, ``impaired_remote_conn_events``.
``lifespan`` is the refresh interval of the counters, not a counter.

A counter's absolute value means little (it grows since boot); what a check judges is how much it grew since
the previous run. The previous values are kept in the history store as a cursor (`cursor_name(node)`); a new
boot id or a counter that went backwards (driver reload) starts over instead of producing a huge or negative
delta.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from gpuguard.model import ProbeStatus
from gpuguard.util.record import Record, field, record

# Counters whose growth points at trouble (the check has a threshold parameter for each group).
ERROR_COUNTERS = ("rx_drops", "retrans_pkts", "retrans_timeout_events", "unresponsive_remote_events",
                  "impaired_remote_conn_events", "rdma_read_wr_err", "rdma_write_wr_err")
NOT_COUNTERS = frozenset({"lifespan"})
CURSOR_PREFIX = "efa_counters:"


def cursor_name(node: str) -> str:
    """Store cursor (Store.get_cursor/set_cursor) under which a node's previous counter values are kept."""
    return f"{CURSOR_PREFIX}{node}"


@record
class EfaPortCounters(Record):
    device: str
    port: int
    values: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.device}/{self.port}"


@record
class EfaCounterObservation(Record):
    status: ProbeStatus = field(default_factory=ProbeStatus)
    ports: list[EfaPortCounters] = field(default_factory=list)
    # "dev/port" -> counter -> growth since the previous run; None on the first run (nothing to compare)
    deltas: Optional[dict[str, dict[str, int]]] = None
    interval_s: Optional[float] = None  # seconds since the previous reading
    reset: list[str] = field(default_factory=list)  # ports whose counters went backwards (driver reload)
    baseline_reason: Optional[str] = None  # why there is no delta this time (first run, reboot)
    cursor: Optional[dict[str, Any]] = None  # what the next run compares against (save with Store.set_cursor)
    unreadable: list[str] = field(default_factory=list)  # counter files that could not be read


def parse_counter_value(text: str) -> Optional[int]:
    """A hw_counters file: a decimal integer; anything else ("N/A (no PMA)", empty) -> None."""
    value = text.strip()
    if not value:
        return None
    try:
        return int(value, 0)
    except ValueError:
        return None


def counter_deltas(previous: dict[str, dict[str, int]], current: dict[str, dict[str, int]]
                   ) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Growth of every counter present in both readings, per port; ports where any counter went backwards are
    listed as reset and their delta is the current value (the counters restarted from zero)."""
    deltas: dict[str, dict[str, int]] = {}
    resets: list[str] = []
    for key, now in current.items():
        before = previous.get(key)
        if before is None:
            continue
        went_back = any(name in before and now[name] < before[name] for name in now)
        if went_back:
            resets.append(key)
            deltas[key] = dict(now)
            continue
        deltas[key] = {name: now[name] - before[name] for name in now if name in before}
    return deltas, resets


def _is_efa(dev_dir: str) -> bool:
    try:
        driver = os.path.basename(os.readlink(os.path.join(dev_dir, "device", "driver")))
    except OSError:
        driver = None
    if driver is not None:
        return driver == "efa"
    return os.path.basename(dev_dir).startswith(("rdmap", "efa_"))


def read_counter_tree(sysfs_root: str = "/sys") -> tuple[list[EfaPortCounters], list[str]]:
    """Every EFA port's hw_counters under <sysfs_root>/class/infiniband. (ports, unreadable files)."""
    base = os.path.join(sysfs_root, "class", "infiniband")  # os.path, not pathlib: this is on the prolog's path
    ports: list[EfaPortCounters] = []
    unreadable: list[str] = []
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return ports, unreadable
    for dev in devices:
        dev_dir = os.path.join(base, dev)
        if not _is_efa(dev_dir):
            continue
        try:
            port_names = sorted((n for n in os.listdir(os.path.join(dev_dir, "ports")) if n.isdigit()), key=int)
        except OSError:
            continue
        for port in port_names:
            hw = os.path.join(dev_dir, "ports", port, "hw_counters")
            if not os.path.isdir(hw):
                continue
            pc = EfaPortCounters(device=dev, port=int(port))
            for name in sorted(os.listdir(hw)):
                path = os.path.join(hw, name)
                if name in NOT_COUNTERS or not os.path.isfile(path):
                    continue
                try:
                    with open(path, errors="replace") as f:
                        value = parse_counter_value(f.read())
                except OSError:
                    value = None
                if value is None:
                    unreadable.append(f"{dev}/{port}/{name}")
                    continue
                pc.values[name] = value
            ports.append(pc)
    return ports, unreadable


def read_efa_counters(sysfs_root: str = "/sys", previous: Optional[dict[str, Any]] = None,
                      boot_id: Optional[str] = None, now: Optional[float] = None) -> EfaCounterObservation:
    """Read the counters and compare with `previous` (the cursor the last run saved). Never raises.

    Save `obs.cursor` after the run with `Store.set_cursor(cursor_name(node), obs.cursor)`.
    """
    t0 = time.monotonic()
    now = time.time() if now is None else now
    obs = EfaCounterObservation()
    try:
        obs.ports, obs.unreadable = read_counter_tree(sysfs_root)
    except Exception as e:  # noqa: BLE001 - a probe never raises
        obs.status = ProbeStatus(complete=False, error=f"sysfs: {type(e).__name__}: {e}")
        return obs
    current = {p.key: dict(p.values) for p in obs.ports}
    obs.cursor = {"ts": now, "boot_id": boot_id, "counters": current}
    prev_counters = previous.get("counters") if isinstance(previous, dict) else None
    if not isinstance(prev_counters, dict):
        obs.baseline_reason = "first reading: counters recorded, nothing to compare yet"
    elif boot_id and previous.get("boot_id") and previous.get("boot_id") != boot_id:  # type: ignore[union-attr]
        obs.baseline_reason = "node rebooted since the last reading: counters start over"
    else:
        clean = {k: {n: int(v) for n, v in vals.items() if isinstance(v, int)}
                 for k, vals in prev_counters.items() if isinstance(vals, dict)}
        obs.deltas, obs.reset = counter_deltas(clean, current)
        ts = previous.get("ts") if isinstance(previous, dict) else None
        obs.interval_s = max(0.0, now - float(ts)) if isinstance(ts, (int, float)) else None
    obs.status.duration_s = time.monotonic() - t0
    return obs
