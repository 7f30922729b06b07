"""What every judge of a training log shares (pure): the thresholds, the flag, and the pieces that group
records into episodes and attempts (every trend restarts at a resumed attempt)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from gpuguard.trainlog.records import IterRecord


@dataclass
class Thresholds:
    spike_ratio: float = 1.3  # loss above this multiple of its trend (median of the last `window` good losses)
    spike_min_delta: float = 0.1  # ... and at least this much above it (noise near 0 is not a spike)
    window: int = 20
    min_history: int = 2  # finite losses needed before a loss spike can be judged
    grad_spike_k: float = 6.0  # grad norm above median + k * MAD (as a standard deviation) of its trailing window
    grad_spike_min_ratio: float = 2.0  # ... and at least this multiple of the median (a flat history has MAD ~0)
    grad_window: int = 50
    grad_min_history: int = 10
    grad_norm_max: Optional[float] = None  # optional absolute ceiling; off by default (the scale is per model)
    # a ceiling relative to the attempt's first grad norms (the median of the first `grad_first` of them): from
    # the second record on, so a short log still flags a 1,000x jump the trailing-window rule cannot judge yet
    grad_ceiling_ratio: float = 100.0
    grad_first: int = 5
    skip_streak: int = 4  # consecutive optimizer steps skipped (fp16 overflow) once training is under way
    throughput_drop: float = 0.2  # sustained: time per sample/token this fraction of the baseline time slower
    throughput_window: int = 20  # baseline: median of the last this-many normal records
    throughput_min_history: int = 5
    throughput_min_records: int = 5  # a drop must last this many consecutive records
    lr_zero_records: int = 3  # lr exactly 0 this many records in a row (one record at warm-up start is normal)
    lr_max_records: int = 20  # lr pinned at its peak for the last this-many records after a warm-up: no decay?


@dataclass
class Flag:
    kind: str
    severity: str  # critical | warning
    iteration: Optional[int]  # first iteration concerned (None: the log does not say)
    last_iteration: Optional[int]
    message: str
    value: Optional[float] = None
    line_no: int = 0  # log line of the first record or event concerned
    count: int = 1  # records (or events) in the episode


def fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def attempt_starts(recs: Sequence[IterRecord]) -> frozenset[int]:
    """Indices of records that start a resumed attempt (scan_log's attempt numbers, or the iteration going
    backwards for records built by hand)."""
    return frozenset(i for i in range(1, len(recs))
                     if recs[i].attempt != recs[i - 1].attempt
                     or (recs[i].iteration is not None and recs[i - 1].iteration is not None
                         and recs[i].iteration < recs[i - 1].iteration))


def primary_loss_key(recs: Iterable[IterRecord]) -> Optional[str]:
    keys = Counter(r.loss_key for r in recs if r.loss_key is not None)
    return keys.most_common(1)[0][0] if keys else None


def iteration_at(recs: Sequence[IterRecord], i: int) -> Optional[int]:
    return recs[i].iteration


def span_text(recs: Sequence[IterRecord], ep: Sequence[int]) -> str:
    first, last = iteration_at(recs, ep[0]), iteration_at(recs, ep[-1])
    if first == last:
        return f"iteration {first}"
    return f"iterations {first}-{last} ({len(ep)} records)"


def episodes(hits: Sequence[int], breaks: frozenset[int]) -> list[list[int]]:
    """Consecutive record indices grouped into episodes, never across a resumed attempt."""
    out: list[list[int]] = []
    for i in hits:
        if out and i == out[-1][-1] + 1 and i not in breaks:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def episode_flags(kind: str, severity: str, recs: Sequence[IterRecord], hits: Sequence[int],
                   breaks: frozenset[int], describe: Callable[[list[int]], tuple[str, Optional[float]]]
                   ) -> list[Flag]:
    flags = []
    for ep in episodes(hits, breaks):
        message, value = describe(ep)
        flags.append(Flag(kind, severity, iteration_at(recs, ep[0]), iteration_at(recs, ep[-1]), message, value,
                          recs[ep[0]].line_no, len(ep)))
    return flags


def attempt_slices(n: int, breaks: frozenset[int]) -> list[range]:
    edges = [0, *sorted(breaks), n]
    return [range(a, b) for a, b in zip(edges, edges[1:]) if b > a]
