"""Flags about how a training run proceeds (pure): sustained throughput drops (per sample or token), a learning
rate stuck at 0 or pinned at its peak, and the frameworks' own NaN/Inf checks and rerun diagnoses."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from gpuguard.trainlog.judging import Flag, Thresholds, attempt_slices, episode_flags, span_text
from gpuguard.trainlog.records import IterRecord, LogEvent, is_finite
from gpuguard.trainlog.stats import median, runs


def throughput_unit(recs: Sequence[IterRecord]) -> Optional[str]:
    """Normalise by the work each line reports: per sample when the batch size is given (batch-size ramps then
    do not look like slowdowns), per token for torchtitan's tokens/s, per iteration otherwise."""
    if any(is_finite(r.iter_time_s) and r.batch_size for r in recs):
        return "s/sample"
    if any(is_finite(r.tokens_per_s) and (r.tokens_per_s or 0) > 0 for r in recs):
        return "s/token"
    if any(is_finite(r.iter_time_s) for r in recs):
        return "s/iteration"
    return None


def cost(r: IterRecord, unit: Optional[str]) -> Optional[float]:
    if unit == "s/sample" and is_finite(r.iter_time_s) and r.batch_size:
        value = (r.iter_time_s or 0.0) / r.batch_size
    elif unit == "s/token" and is_finite(r.tokens_per_s) and (r.tokens_per_s or 0.0) > 0:
        value = 1.0 / (r.tokens_per_s or 1.0)
    elif unit == "s/iteration" and is_finite(r.iter_time_s):
        value = r.iter_time_s or 0.0
    else:
        return None
    return value if value > 0 and math.isfinite(value) else None


def throughput_flags(recs: Sequence[IterRecord], unit: Optional[str], th: Thresholds,
                      breaks: frozenset[int]) -> list[Flag]:
    """A drop is judged on the median of each 3 consecutive values (one slow iteration never crosses) against
    the median of the trailing window of normal values, and must last `throughput_min_records` records."""
    if unit is None or not 0 < th.throughput_drop < 1:
        return []
    ratio = 1.0 / (1.0 - th.throughput_drop)
    flags: list[Flag] = []
    for span in attempt_slices(len(recs), breaks):
        series = [(i, c) for i in span if (c := cost(recs[i], unit)) is not None]
        normal: list[float] = []
        hits: list[int] = []  # positions in `series`
        base_at: dict[int, float] = {}
        for pos, (_, c) in enumerate(series):
            smoothed = median([v for _, v in series[max(0, pos - 2):pos + 1]])
            if len(normal) >= max(1, th.throughput_min_history):
                base = median(normal[-th.throughput_window:])
                if smoothed > base * ratio:
                    hits.append(pos)
                    base_at[pos] = base
                    continue
            normal.append(c)
        for group in runs(hits):
            base = base_at[group[0]]
            slow = [p for p in range(max(0, group[0] - 1), group[-1] + 1) if series[p][1] > base * ratio]
            if len(slow) < th.throughput_min_records:
                continue
            first, last = series[slow[0]][0], series[slow[-1]][0]
            level = median([series[p][1] for p in slow])
            ongoing = group[-1] == len(series) - 1
            flags.append(Flag(
                "throughput_drop", "warning", recs[first].iteration, recs[last].iteration,
                f"throughput down {100 * (1 - base / level):.0f}% for iterations {recs[first].iteration}-"
                f"{recs[last].iteration} ({len(slow)} records): {level:.4g} {unit} vs {base:.4g} before"
                + (", still slow at the end of the log" if ongoing else ""), level, recs[first].line_no, len(slow)))
    return flags


# --------------------------------------------------------------------------- learning rate


def lr_flags(recs: Sequence[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    lrs = [(i, r.lr) for i, r in enumerate(recs) if r.lr is not None and math.isfinite(r.lr)]
    zero = [i for i, lr in lrs if lr == 0.0]
    flags = [f for f in episode_flags(
        "lr_zero", "warning", recs, zero, breaks,
        lambda ep: (f"learning rate stuck at 0 at {span_text(recs, ep)}: nothing is being learned", 0.0))
        if f.count >= th.lr_zero_records]
    if lrs:
        lr_max = max(lr for _, lr in lrs)
        tail = lrs[-th.lr_max_records:]
        # Only after a warm-up: a run that never varied its lr chose a constant schedule on purpose.
        warmed_up = any(lr < lr_max * (1 - 1e-6) for _, lr in lrs[: len(lrs) - len(tail)])
        if lr_max > 0 and warmed_up and len(tail) >= th.lr_max_records and \
                all(math.isclose(lr, lr_max, rel_tol=1e-9) for _, lr in tail):
            first, last = recs[tail[0][0]].iteration, recs[tail[-1][0]].iteration
            flags.append(Flag("lr_stuck_max", "warning", first, last,
                              f"learning rate pinned at its maximum {lr_max:g} for the last {len(tail)} records "
                              f"(iterations {first}-{last}): is the decay schedule running?", lr_max,
                              recs[tail[0][0]].line_no, len(tail)))
    return flags


# --------------------------------------------------------------------------- framework events


def event_flags(recs: Sequence[IterRecord], events: Sequence[LogEvent]) -> list[Flag]:
    """One flag per distinct check message, however many ranks raised it, naming the nodes."""
    groups: dict[tuple[str, str, str], list[LogEvent]] = {}
    first_on: dict[Optional[int], LogEvent] = {}  # Megatron's "First rerun ... reproducible" per iteration
    for e in events:
        if e.kind == "rerun_first":
            first_on[e.iteration] = e
        elif e.kind == "rerun_diagnosis" and e.detail == "possible persistent error" and e.iteration in first_on:
            suspect = first_on[e.iteration]
            e = replace(e, message=f"{e.message}: {suspect.detail} (rank {suspect.rank})", node=suspect.node)
        if e.severity in ("critical", "warning"):
            groups.setdefault((e.kind, e.severity, e.detail or e.message), []).append(e)
    flags = []
    lines = [r.line_no for r in recs]
    for (kind, severity, detail), evs in groups.items():
        first = evs[0]
        iteration = first.iteration
        if iteration is None and recs:  # the last progress line before it
            before = [i for i, n in enumerate(lines) if n < first.line_no]
            iteration = recs[before[-1]].iteration if before else None
        ranks = sorted({e.rank for e in evs if e.rank is not None})
        nodes = sorted({e.node for e in evs if e.node})
        if len(evs) == 1:
            message = first.message
        else:
            where = f" on {len(ranks)} ranks" if ranks else f" ({len(evs)} times)"
            if nodes:
                where += f" (nodes {', '.join(nodes[:4])}{f' +{len(nodes) - 4} more' if len(nodes) > 4 else ''})"
            message = f"{detail}{where}"
        flags.append(Flag(kind, severity, iteration, iteration, message, None, first.line_no, len(evs)))
    return flags
