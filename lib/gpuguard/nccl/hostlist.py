"""Slurm hostlists, pure: `node[1-3,5],gpu-a[01-02]` <-> ['node1', 'node2', 'node3', 'node5', 'gpu-a01', ...].

Kept here (instead of shelling out to `scontrol show hostnames`) so the sweep and the simulated nccl-tests
binary can expand lists without a Slurm round trip. Zero padding is kept (`a[01-10]` -> a01 ... a10).
"""

from __future__ import annotations

import re

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


def compress_hostlist(names: list[str]) -> str:
    """['node1', 'node2', 'node3', 'node5'] -> 'node[1-3,5]' (names without a trailing number kept as they are)."""
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, int]] = []
    plain: list[str] = []
    split = []
    for name in names:
        m = re.match(r"^(.*?)(\d+)$", name)
        if m:
            split.append((m.group(1), m.group(2)))
        else:
            plain.append(name)
    # zero-padded widths per prefix: "a09" makes "a10" part of the same 2-digit group
    padded = {(p, len(d)) for p, d in split if d.startswith("0") and len(d) > 1}
    for prefix, digits in split:
        key = (prefix, len(digits)) if (prefix, len(digits)) in padded else (prefix, 0)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    parts = list(dict.fromkeys(plain))
    for prefix, width in order:
        nums = sorted(set(groups[(prefix, width)]))
        fmt = (lambda n: f"{n:0{width}d}") if width else str
        if len(nums) == 1:
            parts.append(f"{prefix}{fmt(nums[0])}")
            continue
        ranges, start, prev = [], nums[0], nums[0]
        for n in nums[1:] + [None]:  # type: ignore[list-item]
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(fmt(start) if start == prev else f"{fmt(start)}-{fmt(prev)}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)
