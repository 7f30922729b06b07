"""Slurm hostlists, pure: `node[1-3,5],gpu-a[01-02]` <-> ['node1', 'node2', 'node3', 'node5', 'gpu-a01', ...].

Kept here (instead of shelling out to `scontrol show hostnames`) so the sweep and the simulated nccl-tests
binary can expand lists without a Slurm round trip. Zero padding is kept (`a[01-10]` -> a01 ... a10).
"""

from __future__ import annotations

import re
from typing import Iterable

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class HostlistError(ValueError):
    pass


def _split_top(text: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$", item)
    if not m:
        if not _NAME.match(item):
            raise HostlistError(f"bad host name {item!r}")
        return [item]
    prefix, body, suffix = m.groups()
    out: list[str] = []
    for rng in body.split(","):
        lo, sep, hi = rng.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"bad range {rng!r} in {item!r}")
        width = len(lo)
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a > 100000:
            raise HostlistError(f"bad range {rng!r} in {item!r}")
        out += [f"{prefix}{i:0{width}d}" for i in range(a, b + 1)]
    # the suffix may hold another bracket group (rack[1-2]-node[1-4])
    return [name + rest for name in out for rest in (_expand_one(suffix) if "[" in suffix else [suffix])]


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression (duplicates dropped, order kept)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        for name in _expand_one(item):
            if not _NAME.match(name):
                raise HostlistError(f"bad host name {name!r}")
            if name not in names:
                names.append(name)
    return names


def compress_hostlist(names: Iterable[str]) -> str:
    """['node001', 'node002', 'node005', 'gpu-a'] -> 'gpu-a,node[001-002,005]' (Slurm's hostlist notation;
    sorted, duplicates dropped). Zero-padded numbers keep their width (node001 .. node100 are one range),
    unpadded ones group together; names without a trailing number are kept as they are."""
    plain: list[str] = []
    numbered: list[tuple[str, str]] = []
    for name in sorted(set(names)):
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if m:
            numbered.append((m.group(1), m.group(2)))
        else:
            plain.append(name)
    padded = {(p, len(d)) for p, d in numbered if d.startswith("0") and len(d) > 1}
    groups: dict[tuple[str, int], list[int]] = {}
    for prefix, digits in numbered:
        width = len(digits) if (prefix, len(digits)) in padded else 0
        groups.setdefault((prefix, width), []).append(int(digits))
    out = list(plain)
    for (prefix, width), nums in sorted(groups.items()):
        nums.sort()
        ranges: list[str] = []
        start = prev = nums[0]
        for n in nums[1:] + [None]:  # type: ignore[list-item]
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if n is not None:
                start = prev = n
        out.append(f"{prefix}{ranges[0]}" if len(nums) == 1 else f"{prefix}[{','.join(ranges)}]")
    return ",".join(out)
