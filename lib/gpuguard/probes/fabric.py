"""RDMA fabric: devices and ports from sysfs (/sys/class/infiniband), and what `fi_info -p efa` reports.

sysfs gives the hardware view (is each EFA/IB port ACTIVE and LinkUp, at what rate); fi_info gives the
libfabric view (can the provider NCCL's aws-ofi-nccl plugin uses actually open the devices). A node can fail
either way on its own, so both are gathered.

Command/parse split: `parse_fi_info` is pure and tested on recorded outputs; `run_fi_info` only runs the tool.
"""

from __future__ import annotations

import os
import re
import time
from typing import Iterable, Optional

from gpuguard.model import FabricObservation, FiInfo, ProbeStatus, RdmaDevice, RdmaPort
from gpuguard.util.toolrun import run_tool
from gpuguard.util.lazyre import lazy

# --------------------------------------------------------------------------- sysfs

_EFA_NAME_PREFIXES = ("rdmap", "efa_")  # rdmap16s27 (predictable names), efa_0 (older kernels)
_MLX_NAME_PREFIXES = ("mlx5_", "mlx4_")
_MLX_DRIVERS = {"mlx5_core", "mlx4_core"}


def parse_sysfs_state(text: Optional[str]) -> Optional[str]:
    """'4: ACTIVE' -> 'ACTIVE', '5: LinkUp' -> 'LinkUp' (the kernel prefixes the numeric code)."""
    if text is None:
        return None
    value = text.strip()
    if not value:
        return None
    code, sep, name = value.partition(":")
    if sep and code.strip().isdigit():
        return name.strip() or None
    return value


def classify_rdma_device(name: str, driver: Optional[str], link_layers: Iterable[Optional[str]]) -> str:
    """'efa' | 'ib' | 'roce' | 'other', from the bound driver when known, else the device name."""
    layers = {ll.strip().lower() for ll in link_layers if ll}
    if driver == "efa" or (driver is None and name.startswith(_EFA_NAME_PREFIXES)):
        return "efa"
    if "infiniband" in layers:
        return "ib"
    is_mlx = driver in _MLX_DRIVERS or (driver is None and name.startswith(_MLX_NAME_PREFIXES))
    if is_mlx:
        # an mlx device whose link layer we could not read is most likely IB; Ethernet means RoCE
        return "roce" if "ethernet" in layers else "ib"
    return "other"


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _natural_key(name: str) -> list[object]:
    """mlx5_2 before mlx5_10; ports 1, 2, ..., 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _driver_name(dev_dir: str) -> Optional[str]:
    # <dev>/device is the PCI device; its `driver` symlink names the bound kernel driver (efa, mlx5_core)
    try:
        return os.path.basename(os.readlink(os.path.join(dev_dir, "device", "driver"))) or None
    except OSError:
        return None


def _read_ports(dev_dir: str) -> list[RdmaPort]:
    ports_dir = os.path.join(dev_dir, "ports")
    try:
        entries = [n for n in os.listdir(ports_dir) if n.isdigit()]
    except OSError:
        return []
    ports = []
    for n in sorted(entries, key=int):
        pdir = os.path.join(ports_dir, n)
        ports.append(
            RdmaPort(
                port=int(n),
                state=parse_sysfs_state(_read_text(os.path.join(pdir, "state"))),
                phys_state=parse_sysfs_state(_read_text(os.path.join(pdir, "phys_state"))),
                rate=_read_text(os.path.join(pdir, "rate")) or None,
                link_layer=_read_text(os.path.join(pdir, "link_layer")) or None,
            )
        )
    return ports


def read_rdma_devices(sysfs_root: str = "/sys") -> list[RdmaDevice]:
    """Every RDMA device under <sysfs_root>/class/infiniband with its ports. No such directory -> []."""
    base = os.path.join(sysfs_root, "class", "infiniband")  # os.path, not pathlib: this is on the prolog's path
    try:
        names = sorted(os.listdir(base), key=_natural_key)
    except OSError:
        return []
    devices = []
    for name in names:
        dev_dir = os.path.join(base, name)
        ports = _read_ports(dev_dir)
        kind = classify_rdma_device(name, _driver_name(dev_dir), (p.link_layer for p in ports))
        devices.append(RdmaDevice(name=name, kind=kind, ports=ports))
    return devices


# --------------------------------------------------------------------------- fi_info

# Prefixes that launchers add to each line: `srun -l` ("0: "), `mpirun --tag-output` ("[1,0]<stdout>:").
_LINE_PREFIX_RE = lazy(r"^(?:\[\d+,\d+\]<std(?:out|err)>:|\d+:\s)")
_ENTRY_FIELD_RE = lazy(r"^\s*([A-Za-z_]+):\s*(.*?)\s*$")
_DOMAIN_SUFFIX_RE = lazy(r"-(?:rdm|dgrm)$")


def _entries(text: str) -> tuple[list[dict[str, str]], list[str]]:
    """fi_info's `provider:` blocks as dicts, and any `fi_getinfo: ...` error lines."""
    entries: list[dict[str, str]] = []
    errors: list[str] = []
    current: Optional[dict[str, str]] = None
    for raw in text.splitlines():
        line = _LINE_PREFIX_RE.sub("", raw.rstrip())
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):  # '#' lines: fixture source notes, comments
            continue
        if stripped.startswith("fi_getinfo:"):
            errors.append(stripped)
            continue
        m = _ENTRY_FIELD_RE.match(line)
        if not m:
            continue
        key, value = m.group(1), m.group(2)
        if key == "provider" and not line[:1].isspace():
            current = {"provider": value}
            entries.append(current)
        elif current is not None and key not in current:
            current[key] = value
    return entries, errors


def device_of_domain(domain: str) -> str:
    """'rdmap16s27-rdm' -> 'rdmap16s27', 'efa_0-dgrm' -> 'efa_0': one physical device per name."""
    return _DOMAIN_SUFFIX_RE.sub("", domain.strip())


def parse_fi_info(text: str, provider: str = "efa") -> FiInfo:
    """What `fi_info -p <provider>` printed, counted per physical device.

    One EFA device appears several times: an RDM and a DGRAM domain (`<dev>-rdm`, `<dev>-dgrm`), a layered
    `efa;ofi_rxd` entry on old libfabric, and since libfabric 2.x a second RDM entry under fabric
    `efa-direct`. Stripping the domain suffix and de-duplicating counts each device once, whatever the
    fabric is called (`EFA-fe80::...` legacy, `efa`, `efa-direct`).
    """
    entries, errors = _entries(text)
    devices: list[str] = []
    found = False
    for entry in entries:
        if provider not in (p.strip() for p in entry["provider"].split(";")):
            continue
        found = True
        domain = entry.get("domain", "")
        name = device_of_domain(domain) if domain else entry.get("fabric", "")
        if name and name not in devices:
            devices.append(name)
    return FiInfo(
        ran=True,
        provider_found=found,
        devices=len(devices),
        domains=devices,
        error=None if found else (errors[0] if errors else None),
    )


def _run_fi_info(fi_info: str, provider: str, timeout_s: float) -> tuple[FiInfo, bool]:
    """(result, timed_out)."""
    run = run_tool([fi_info, "-p", provider], timeout_s)
    if run.timed_out:
        return FiInfo(ran=False, error=f"fi_info timed out after {timeout_s:g}s"), True
    if run.rc is None:
        return FiInfo(ran=False, error=run.error), False
    out, err = run.text(), run.stderr.decode("utf-8", errors="replace")
    result = parse_fi_info(out, provider)
    if not result.provider_found:
        err_info = parse_fi_info(err, provider)
        message = err_info.error or (err.strip().splitlines() or [None])[-1]
        if message is None and run.rc != 0:
            message = f"fi_info exited {run.rc}"
        result.error = result.error or message
    return result, False


def run_fi_info(fi_info: str = "fi_info", provider: str = "efa", timeout_s: float = 5.0) -> FiInfo:
    """Run `fi_info -p <provider>` (argv list, no shell) with a hard timeout and parse it. Never raises."""
    return _run_fi_info(fi_info, provider, timeout_s)[0]


# --------------------------------------------------------------------------- combined


def read_fabric(sysfs_root: str = "/sys", fi_info: str | None = None, timeout_s: float = 5.0) -> FabricObservation:
    """sysfs devices, plus `fi_info -p efa` when a tool path is given. Never raises.

    A missing /sys/class/infiniband is not an error (the node simply has no RDMA devices); a fi_info that
    cannot run or times out makes the observation incomplete.
    """
    start = time.monotonic()
    status = ProbeStatus()
    obs = FabricObservation(status=status)
    try:
        obs.devices = read_rdma_devices(sysfs_root)
        obs.devices_complete = True
    except Exception as e:  # noqa: BLE001 - a probe never raises
        obs.devices_complete = False
        status.complete = False
        status.error = f"sysfs: {type(e).__name__}: {e}"
    if fi_info is not None:
        try:
            info, timed_out = _run_fi_info(fi_info, "efa", timeout_s)
        except Exception as e:  # noqa: BLE001
            info, timed_out = FiInfo(ran=False, error=f"{type(e).__name__}: {e}"), False
        obs.fi_info = info
        if not info.ran:
            status.complete = False
            status.timed_out = status.timed_out or timed_out
            status.error = "; ".join(x for x in (status.error, f"fi_info: {info.error}") if x)
    status.duration_s = time.monotonic() - start
    return obs
