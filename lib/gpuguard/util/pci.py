"""PCI addresses as gpuguard compares them. Pure."""

from __future__ import annotations


def pci_key(address: str) -> str:
    """A PCI address as `dddd:bb:dd` (lower case, no function): the kernel's Xid lines write `0000:86:00`, NVML
    `00000000:86:00.0`."""
    text = address.strip().lower()
    parts = text.split(".")[0].split(":")
    if len(parts) < 3:
        return text
    try:
        return f"{int(parts[-3], 16):04x}:{parts[-2]}:{parts[-1]}"
    except ValueError:
        return text
