"""Fake sysfs trees for tests and simulation, laid out the way the kernel lays out the real ones.

Real layout (abridged)::

    /sys/class/infiniband/mlx5_0 -> ../../devices/pci0000:00/0000:00:04.0/infiniband/mlx5_0
    /sys/devices/pci0000:00/0000:00:04.0/driver -> ../../../bus/pci/drivers/mlx5_core
    .../infiniband/mlx5_0/device -> ../../../0000:00:04.0
    .../infiniband/mlx5_0/ports/1/{state,phys_state,rate,link_layer}   e.g. "4: ACTIVE", "5: LinkUp"

so that the probe reading the fake tree exercises exactly the code path it uses on a node.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

# ib_verbs.h enum ib_port_state and the kernel's phys_state names (drivers/infiniband/core/sysfs.c)
PORT_STATES = {"NOP": 0, "DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4, "ACTIVE_DEFER": 5}
PHYS_STATES = {
    "Sleep": 1,
    "Polling": 2,
    "Disabled": 3,
    "PortConfigurationTraining": 4,
    "LinkUp": 5,
    "LinkErrorRecovery": 6,
    "Phy Test": 7,
}

_DEFAULTS: dict[str, dict[str, str]] = {
    # kind -> driver, link layer, rate as the kernel prints them
    "efa": {"driver": "efa", "link_layer": "Unspecified", "rate": "100 Gb/sec (4X EDR)"},
    "ib": {"driver": "mlx5_core", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"},
    "roce": {"driver": "mlx5_core", "link_layer": "Ethernet", "rate": "200 Gb/sec (4X HDR)"},
    "other": {"driver": "", "link_layer": "Ethernet", "rate": "100 Gb/sec (4X EDR)"},
}


def format_port_state(value: str) -> str:
    """'ACTIVE' -> '4: ACTIVE'; an already formatted '4: ACTIVE' is kept."""
    if ":" in value:
        return value
    return f"{PORT_STATES.get(value.upper(), 0)}: {value.upper()}"


def format_phys_state(value: str) -> str:
    """'LinkUp' -> '5: LinkUp'; an already formatted value is kept."""
    if ":" in value:
        return value
    return f"{PHYS_STATES.get(value, 0)}: {value}"


def _put(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def _link(link: str, target: str) -> None:
    """`link` -> `target`, relative as the kernel's links are, replacing whatever was at `link`."""
    relative = os.path.relpath(target, os.path.dirname(link))
    try:
        os.symlink(relative, link)
    except FileExistsError:
        os.unlink(link)
        os.symlink(relative, link)


def write_fake_infiniband(root: Path, devices: Sequence[Mapping[str, Any]]) -> None:
    """Create <root>/class/infiniband/<name>/... for each device dict.

    A device: ``{"name": "rdmap16s27", "kind": "efa", "ports": [{"port": 1, "state": "ACTIVE",
    "phys_state": "LinkUp", "rate": "100 Gb/sec (4X EDR)", "link_layer": "Unspecified"}]}``.
    `kind` (efa | ib | roce | other) picks the bound driver and per-port defaults; "driver" overrides the
    driver ("" for none). A device without "ports" gets one ACTIVE/LinkUp port 1. Port keys left out take
    the kind's defaults; a key set to None is not written (a missing sysfs file).

    Plain os calls, one per file, link and directory: a simulated p5 node has 32 EFA devices, and every new or
    changed scenario writes them all again.
    """
    root = os.fspath(root)
    class_dir = os.path.join(root, "class", "infiniband")
    # the devices of a previous scenario go: a device the new one lacks must look gone, as on a real node
    for old in (class_dir, os.path.join(root, "devices", "pci0000:00")):
        shutil.rmtree(old, ignore_errors=True)
    if devices:
        os.makedirs(class_dir)
    drivers: set[str] = set()
    for index, dev in enumerate(devices):
        name = str(dev["name"])
        kind = str(dev.get("kind", "other"))
        defaults = _DEFAULTS.get(kind, _DEFAULTS["other"])
        driver = dev.get("driver", defaults["driver"])
        bdf = dev.get("pci", f"0000:00:{index + 4:02x}.0")
        pci_dir = os.path.join(root, "devices", "pci0000:00", bdf)
        dev_dir = os.path.join(pci_dir, "infiniband", name)
        os.makedirs(dev_dir, exist_ok=True)
        if driver:
            drv_dir = os.path.join(root, "bus", "pci", "drivers", str(driver))
            if drv_dir not in drivers:
                os.makedirs(drv_dir, exist_ok=True)
                drivers.add(drv_dir)
            _link(os.path.join(pci_dir, "driver"), drv_dir)
        _link(os.path.join(dev_dir, "device"), pci_dir)
        _put(os.path.join(dev_dir, "node_type"), "1: CA")
        _link(os.path.join(class_dir, name), dev_dir)
        ports = dev.get("ports") or [{"port": 1}]
        for pnum, port in enumerate(ports, start=1):
            pdir = os.path.join(dev_dir, "ports", str(port.get("port", pnum)))
            os.makedirs(pdir, exist_ok=True)
            values = {
                "state": port.get("state", "ACTIVE"),
                "phys_state": port.get("phys_state", "LinkUp"),
                "rate": port.get("rate", defaults["rate"]),
                "link_layer": port.get("link_layer", defaults["link_layer"]),
            }
            for key, value in values.items():
                if value is None:
                    continue
                if key == "state":
                    value = format_port_state(str(value))
                elif key == "phys_state":
                    value = format_phys_state(str(value))
                _put(os.path.join(pdir, key), str(value))
