"""What every `make bench` figure is printed with: its spread over the runs, the load the machine was under while it
was measured, and a verdict that says when the machine was too busy to judge.

A figure is the median of N runs with its 10th-90th percentile range ("0.123 s [0.110-0.150] n=40"). A target
judged against a yardstick (NHC, `grep -c`, `Prolog=/bin/true`) compares two figures measured in the same run,
interleaved, so that load from anything else on the machine falls on both alike. The load is the 1-minute load
average before and after the measurement; above the number of CPUs (other work was waiting for a core most of the
time, and our own figures too) the verdict is BUSY, with what the run gave in brackets: not a PASS or a MISS.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

PASS, MISS, BUSY = "PASS", "MISS", "BUSY"


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of `values`."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * (len(s) - 1)))))]


def spread(values: Sequence[float], unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    """'median [p10-p90] n=N' of `values` (times `scale`, in `unit`)."""
    v = [x * scale for x in values]
    if not v:
        return "no samples"
    if len(v) == 1:
        return f"{v[0]:.{digits}f} {unit} (n=1)"
    return (f"{statistics.median(v):.{digits}f} {unit} [{pct(v, 10):.{digits}f}-{pct(v, 90):.{digits}f}] "
            f"n={len(v)}")


def ratio_spread(values: Sequence[float], yardstick: Sequence[float]) -> tuple[float, str]:
    """(median / median, 'R x [p10-p90 of the per-round ratios]'): the rounds are interleaved pairs."""
    r = statistics.median(values) / statistics.median(yardstick)
    per_round = [a / b for a, b in zip(values, yardstick) if b > 0]
    if len(per_round) < 2:
        return r, f"{r:.2f}x"
    return r, f"{r:.2f}x [{pct(per_round, 10):.2f}-{pct(per_round, 90):.2f}]"


@dataclass
class Load:
    """The 1-minute load average before and after a measurement, on this many CPUs."""

    before: float
    after: float = float("nan")
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    seconds: float = 0.0

    @property
    def busy(self) -> bool:
        return max(self.before, self.after) > self.cpus

    def text(self) -> str:
        return f"load {self.before:.2f} -> {self.after:.2f} on {self.cpus} CPUs"


class Measuring:
    """`with Measuring() as load:` ... the load before and after the block (and how long it took), printed unless
    `quiet`."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    def __enter__(self) -> Load:
        self.load = Load(before=os.getloadavg()[0])
        self.t0 = time.monotonic()
        return self.load

    def __exit__(self, *exc: object) -> None:
        self.load.after = os.getloadavg()[0]
        self.load.seconds = time.monotonic() - self.t0
        if not self.quiet:
            print(f"  ({self.load.text()}; {self.load.seconds:.0f} s"
                  f"{', too busy to judge' if self.load.busy else ''})", flush=True)


def verdict(ok: Optional[bool], load: Optional[Load]) -> str:
    if ok is None:
        return "-"
    said = PASS if ok else MISS
    return f"{BUSY} ({said})" if load is not None and load.busy else said


@dataclass
class Row:
    what: str
    value: str
    yardstick: str
    ratio: str
    target: str
    verdict: str
    load: str
    key: bool = False  # one of the targets the summary puts first


@dataclass
class Table:
    rows: list[Row] = field(default_factory=list)

    def row(self, what: str, value: str, target: str, ok: Optional[bool], yardstick: str = "-",
            ratio: Optional[float | str] = None, load: Optional[Load] = None, key: bool = False) -> None:
        r = "-" if ratio is None else (ratio if isinstance(ratio, str) else f"{ratio:.2f}x")
        row = Row(what, value, yardstick, r, target, verdict(ok, load), load.text() if load else "-", key)
        self.rows.append(row)
        beside = "" if yardstick == "-" else f" | {yardstick} | {r}"
        print(f"  {what}: {value}{beside} (target {target}) {row.verdict}", flush=True)

    def missing(self, what: str, target: str, why: str) -> None:
        """A key target that could not be measured in this run (no yardstick, a section skipped)."""
        self.rows.append(Row(what, "not measured", why, "-", target, "NOT MEASURED", "-", key=True))

    def print(self) -> None:
        print("\n| measurement | gpuguard: median [p10-p90] n | yardstick, same run | ratio [p10-p90 per round] "
              "| target | load (1-min avg) before -> after | |\n|---|---|---|---|---|---|---|")
        for r in sorted(self.rows, key=lambda r: not r.key):  # stable: the key targets first, in run order
            what = f"**{r.what}**" if r.key else r.what
            print(f"| {what} | {r.value} | {r.yardstick} | {r.ratio} | {r.target} | {r.load} | {r.verdict} |")
        counts = {v: sum(1 for r in self.rows if r.verdict.split(" ")[0] == v) for v in (PASS, MISS, BUSY)}
        unmeasured = sum(1 for r in self.rows if r.verdict == "NOT MEASURED")
        print(f"\ntargets: {counts[PASS]} PASS, {counts[MISS]} MISS, {counts[BUSY]} BUSY (load average above the "
              f"CPU count: too busy to judge; what the run gave in brackets), {unmeasured} not measured")

    @property
    def missed(self) -> bool:
        return any(r.verdict == MISS for r in self.rows)
