"""Judging a parsed training log: summary figures and flags. Pure: records and events in, `Analysis` out.

Critical (the run is producing garbage or the framework said so): a NaN/inf loss; a Megatron line without its
loss (Megatron prints a loss only if its interval average is > 0, so a NaN average is simply absent); Megatron's
"number of nan iterations" > 0; a NaN/inf grad norm; optimizer steps skipped once training is under way with a
whole interval skipped or the fp16 loss scale already down to 1; a framework NaN/Inf check firing (Megatron's
"found NaN in local grad norm ...", DeepSpeed's loss scale at its minimum) or Megatron's rerun diagnosis naming a
GPU whose result does not reproduce.

Warnings: a loss spike above its recent trend; a grad-norm spike against the run's own history (median + k x MAD
over a trailing window, not a fixed number: grad norms of 1 and of 100000 are both normal for some run); grad
norm exactly 0; a sustained throughput drop (time per *sample* when the line gives the batch size, so batch-size
ramps do not count, per token for torchtitan; one slow iteration -- a checkpoint, an evaluation -- is not a drop);
the learning rate stuck at 0 or pinned at its peak.

Every trend restarts at a resumed attempt: the resumed run's loss level and speed are its own."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Sequence

from gpuguard.trainlog.records import IterRecord, LogEvent, is_finite
from gpuguard.trainlog.stats import mad, median, percentile, runs


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


@dataclass
class Analysis:
    records: int
    first_iteration: Optional[int]
    last_iteration: Optional[int]
    formats: list[str]
    loss_key: Optional[str]
    loss_first: Optional[float]
    loss_last: Optional[float]
    loss_min: Optional[float]
    iter_time_median_s: Optional[float]
    iter_time_p95_s: Optional[float]
    throughput_unit: Optional[str]  # s/sample | s/token | s/iteration
    throughput_median: Optional[float]
    lr_last: Optional[float]
    lr_max: Optional[float]
    grad_norm_median: Optional[float]
    grad_norm_max: Optional[float]
    skipped_iterations: int = 0
    nan_iterations: int = 0
    overflows: int = 0  # DeepSpeed fp16 "OVERFLOW! ... Skipping step" lines
    duplicates: int = 0  # other ranks' copies and progress-bar redraws that were dropped
    incomplete: int = 0  # progress lines cut short (a log being written, an excerpt): not judged
    restarts: list[int] = field(default_factory=list)  # iteration each resumed attempt started at
    flags: list[Flag] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))

    @property
    def critical(self) -> bool:
        return any(f.severity == "critical" for f in self.flags)


def _json_safe(obj: Any) -> Any:
    """JSON has no NaN/inf: spell them as strings so `--json` output is valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


# --------------------------------------------------------------------------- shared pieces


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


def _it(recs: Sequence[IterRecord], i: int) -> Optional[int]:
    return recs[i].iteration


def _span(recs: Sequence[IterRecord], ep: Sequence[int]) -> str:
    first, last = _it(recs, ep[0]), _it(recs, ep[-1])
    if first == last:
        return f"iteration {first}"
    return f"iterations {first}-{last} ({len(ep)} records)"


def _episodes(hits: Sequence[int], breaks: frozenset[int]) -> list[list[int]]:
    """Consecutive record indices grouped into episodes, never across a resumed attempt."""
    out: list[list[int]] = []
    for i in hits:
        if out and i == out[-1][-1] + 1 and i not in breaks:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _episode_flags(kind: str, severity: str, recs: Sequence[IterRecord], hits: Sequence[int],
                   breaks: frozenset[int], describe: Callable[[list[int]], tuple[str, Optional[float]]]
                   ) -> list[Flag]:
    flags = []
    for ep in _episodes(hits, breaks):
        message, value = describe(ep)
        flags.append(Flag(kind, severity, _it(recs, ep[0]), _it(recs, ep[-1]), message, value,
                          recs[ep[0]].line_no, len(ep)))
    return flags


def _attempt_slices(n: int, breaks: frozenset[int]) -> list[range]:
    edges = [0, *sorted(breaks), n]
    return [range(a, b) for a, b in zip(edges, edges[1:]) if b > a]


# --------------------------------------------------------------------------- non-finite values and skips


def _interval(recs: Sequence[IterRecord], i: int, breaks: frozenset[int]) -> Optional[int]:
    """Iterations covered by record i (the distance from the previous record of the same attempt)."""
    if i == 0 or i in breaks:
        return None
    a, b = recs[i - 1].iteration, recs[i].iteration
    return b - a if a is not None and b is not None and b > a else None


def _all_skipped(recs: Sequence[IterRecord], i: int, breaks: frozenset[int]) -> bool:
    skipped = recs[i].skipped_iterations or 0
    interval = _interval(recs, i, breaks)
    return skipped > 0 and (interval is None or skipped >= interval)


def _nonfinite_flags(recs: Sequence[IterRecord], key: Optional[str], breaks: frozenset[int]) -> list[Flag]:
    flags: list[Flag] = []
    nan_loss = [i for i, r in enumerate(recs) if any(not math.isfinite(v) for v in r.losses.values())]

    def nan_message(ep: list[int]) -> tuple[str, Optional[float]]:
        r = recs[ep[0]]
        name, value = next((k, v) for k, v in r.losses.items() if not math.isfinite(v))
        return f"{name} is {value} at {_span(recs, ep)}", value

    flags += _episode_flags("nan_loss", "critical", recs, nan_loss, breaks, nan_message)

    missing = [i for i, r in enumerate(recs) if r.fmt == "megatron" and i not in nan_loss
               and (r.loss is None or (key is not None and r.loss_key != key))
               and not _all_skipped(recs, i, breaks) and not r.nan_iterations]
    flags += _episode_flags(
        "loss_missing", "critical", recs, missing, breaks,
        lambda ep: (f"{key or 'lm loss'} absent at {_span(recs, ep)}: Megatron prints a loss only when its "
                    "interval average is > 0, so a NaN loss leaves the line without one", None))

    nan_its = [i for i, r in enumerate(recs) if r.nan_iterations]
    flags += _episode_flags(
        "nan_iterations", "critical", recs, nan_its, breaks,
        lambda ep: (f"{sum(recs[i].nan_iterations or 0 for i in ep)} NaN iteration(s) reported (Megatron's "
                    f"\"number of nan iterations\") at {_span(recs, ep)}", float(recs[ep[0]].nan_iterations or 0)))

    bad_grad = [i for i, r in enumerate(recs) if r.grad_norm is not None and not math.isfinite(r.grad_norm)]
    flags += _episode_flags(
        "grad_norm_nonfinite", "critical", recs, bad_grad, breaks,
        lambda ep: (f"grad norm is {recs[ep[0]].grad_norm} at {_span(recs, ep)}", recs[ep[0]].grad_norm))
    return flags


def _skip_flags(recs: Sequence[IterRecord], breaks: frozenset[int]) -> list[Flag]:
    """fp16 dynamic loss scaling skips a step and halves the scale on overflow: while it calibrates at the start
    of an attempt, and now and then afterwards, that is normal. It is not once training is under way and a
    whole log interval was skipped, nor when the scale is already down to 1 (nothing left to back off)."""
    hits = []
    for span in _attempt_slices(len(recs), breaks):
        started = False
        for i in span:
            r = recs[i]
            overflows = (r.skipped_iterations or 0) - (r.nan_iterations or 0)  # NaN ones are flagged as such
            if overflows > 0 and ((r.loss_scale is not None and r.loss_scale <= 1.0)
                                  or (started and _all_skipped(recs, i, breaks))):
                hits.append(i)
            started = started or r.loss is not None
    return _episode_flags(
        "skipped_iterations", "critical", recs, hits, breaks,
        lambda ep: (f"{sum(recs[i].skipped_iterations or 0 for i in ep)} optimizer step(s) skipped at "
                    f"{_span(recs, ep)} (loss scale {fmt(recs[ep[-1]].loss_scale)}): overflowing gradients the "
                    "loss scaler cannot absorb", float(recs[ep[0]].skipped_iterations or 0)))


WARMUP_MIN_SCALE = 1024.0  # fp16 loss scalers start at 2^16 (DeepSpeed's default) or higher, never this low


def _overflow_streaks(recs: Sequence[IterRecord], events: Sequence[LogEvent], th: Thresholds) -> list[Flag]:
    """DeepSpeed skips a step and halves the loss scale on each fp16 overflow ("Attempted loss scale: S, reducing
    to S/2"). While it calibrates at the start of a run that happens many times in a row, from its initial scale
    (2^16 by default, up to 2^32), normal; later an overflow or two now and then is normal too. `skip_streak` or
    more in a row (each attempt at the scale the previous one reduced to) once training is under way is not: the
    gradients overflow faster than the scaler can back off. Under way: a loss was logged before the streak, it is
    not the attempt's first streak, or it starts below any initial scale (WARMUP_MIN_SCALE)."""
    flags: list[Flag] = []
    overflow = [e for e in events if e.kind == "overflow"]
    if not overflow:
        return flags
    loss_lines = sorted(r.line_no for r in recs if r.loss is not None)
    resumes = [e.line_no for e in events if e.kind == "resume"]
    streaks: list[list[LogEvent]] = []
    for e in overflow:
        prev = streaks[-1][-1] if streaks else None
        chained = prev is not None and prev.scale_to is not None and e.scale_from == prev.scale_to \
            and not any(prev.line_no < r < e.line_no for r in resumes)
        hysteresis = prev is not None and prev.scale_to is None and e.scale_from == prev.scale_from
        if chained or hysteresis:
            streaks[-1].append(e)
        else:
            streaks.append([e])
    for k, streak in enumerate(streaks):
        first_of_attempt = k == 0 or any(streaks[k - 1][-1].line_no < r < streak[0].line_no for r in resumes)
        attempt_start = max([r for r in resumes if r < streak[0].line_no], default=0)
        under_way = any(attempt_start < n < streak[0].line_no for n in loss_lines) or not first_of_attempt \
            or (streak[0].scale_from is not None and streak[0].scale_from < WARMUP_MIN_SCALE)
        skipped = sum(1 for e in streak if e.scale_to is not None)
        if under_way and skipped >= th.skip_streak:
            start, end = streak[0], streak[-1]
            flags.append(Flag("skip_streak", "critical", start.iteration, end.iteration,
                              f"{skipped} optimizer steps skipped in a row (fp16 overflow; loss scale "
                              f"{fmt(start.scale_from)} -> {fmt(end.scale_to)}) once training was under way: "
                              "the gradients overflow faster than the loss scaler can back off", float(skipped),
                              start.line_no, len(streak)))
    return flags


def _megatron_skip_streaks(recs: Sequence[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    """Megatron logs how many steps of each interval were skipped: consecutive intervals with skips, the loss
    scale falling, `skip_streak` or more in all, once training is under way (whole skipped intervals are
    `skipped_iterations` already)."""
    hits: list[list[int]] = []
    for span in _attempt_slices(len(recs), breaks):
        started, run = False, []
        for i in span:
            r = recs[i]
            overflows = (r.skipped_iterations or 0) - (r.nan_iterations or 0)
            falling = not run or (r.loss_scale is not None and recs[run[-1]].loss_scale is not None
                                  and r.loss_scale < (recs[run[-1]].loss_scale or 0.0))
            if overflows > 0 and started and falling and not _all_skipped(recs, i, breaks):
                run.append(i)
            else:
                if sum((recs[j].skipped_iterations or 0) for j in run) >= th.skip_streak and len(run) > 1:
                    hits.append(run)
                run = [i] if overflows > 0 and started and not _all_skipped(recs, i, breaks) else []
            started = started or r.loss is not None
        if sum((recs[j].skipped_iterations or 0) for j in run) >= th.skip_streak and len(run) > 1:
            hits.append(run)
    return [Flag("skip_streak", "critical", recs[run[0]].iteration, recs[run[-1]].iteration,
                 f"{sum(recs[j].skipped_iterations or 0 for j in run)} optimizer steps skipped in consecutive "
                 f"intervals at {_span(recs, run)}, loss scale falling to {fmt(recs[run[-1]].loss_scale)}: "
                 "overflowing gradients the loss scaler cannot absorb",
                 float(sum(recs[j].skipped_iterations or 0 for j in run)), recs[run[0]].line_no, len(run))
            for run in hits]


# --------------------------------------------------------------------------- loss and grad-norm spikes


def _loss_spike_flags(recs: Sequence[IterRecord], key: Optional[str], th: Thresholds,
                      breaks: frozenset[int]) -> list[Flag]:
    hits: list[int] = []
    trend_at: dict[int, float] = {}
    for span in _attempt_slices(len(recs), breaks):
        good: list[float] = []  # recent losses that were neither NaN nor part of a spike: the trend
        for i in span:
            r = recs[i]
            if r.loss is None or r.loss_key != key or not math.isfinite(r.loss):
                continue
            if len(good) >= max(1, th.min_history):
                trend = median(good[-th.window:])
                if r.loss > trend * th.spike_ratio and r.loss - trend >= th.spike_min_delta:
                    hits.append(i)
                    trend_at[i] = trend
                    continue
            good.append(r.loss)

    def describe(ep: list[int]) -> tuple[str, Optional[float]]:
        peak_i = max(ep, key=lambda i: recs[i].loss or 0.0)
        peak, trend = recs[peak_i].loss or 0.0, trend_at[ep[0]]
        ratio = f" ({peak / trend:.2f}x)" if trend > 0 else ""
        return (f"loss spike at {_span(recs, ep)}: peak {fmt(peak)} at iteration {recs[peak_i].iteration} vs "
                f"trend {fmt(trend)}{ratio}", peak)

    return _episode_flags("loss_spike", "warning", recs, hits, breaks, describe)


def _grad_flags(recs: Sequence[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    flags: list[Flag] = []
    hits: list[int] = []
    base_at: dict[int, tuple[float, float]] = {}
    for span in _attempt_slices(len(recs), breaks):
        history: list[float] = []
        for i in span:
            g = recs[i].grad_norm
            if g is None or not math.isfinite(g) or g <= 0:
                continue
            first = history[:th.grad_first]
            if first:
                base = median(first)
                if g > base * th.grad_ceiling_ratio:
                    hits.append(i)
                    base_at[i] = (base, base * th.grad_ceiling_ratio)
                    continue
            if len(history) >= max(1, th.grad_min_history):
                window = history[-th.grad_window:]
                med = median(window)
                limit = max(med + th.grad_spike_k * mad(window, med), med * th.grad_spike_min_ratio)
                if g > limit:
                    hits.append(i)
                    base_at[i] = (med, limit)
                    continue
            history.append(g)

    def spike(ep: list[int]) -> tuple[str, Optional[float]]:
        peak_i = max(ep, key=lambda i: recs[i].grad_norm or 0.0)
        peak, (med, limit) = recs[peak_i].grad_norm or 0.0, base_at[ep[0]]
        if limit == med * th.grad_ceiling_ratio:
            return (f"grad norm spike at {_span(recs, ep)}: peak {fmt(peak)} at iteration {recs[peak_i].iteration}, "
                    f"{peak / med:.0f}x the run's first grad norms (median {fmt(med)}; limit "
                    f"{th.grad_ceiling_ratio:g}x)", peak)
        return (f"grad norm spike at {_span(recs, ep)}: peak {fmt(peak)} at iteration {recs[peak_i].iteration} vs "
                f"the run's median {fmt(med)} (limit median + {th.grad_spike_k:g} MAD = {fmt(limit)})", peak)

    flags += _episode_flags("grad_norm_spike", "warning", recs, hits, breaks, spike)

    zero = [i for i, r in enumerate(recs) if r.grad_norm == 0.0]
    everywhere = len(zero) == sum(1 for r in recs if r.grad_norm is not None)
    flags += _episode_flags(
        "grad_norm_zero", "warning", recs, zero, breaks,
        lambda ep: (f"grad norm exactly 0 at {_span(recs, ep)}"
                    + (": on every line, so this setup does not report it (DeepSpeed pipeline parallelism logs "
                       "0.000) or no gradient flows" if everywhere else ": no gradient reached the optimizer"),
                    0.0))
    if th.grad_norm_max is not None:
        ceiling = th.grad_norm_max
        high = [i for i, r in enumerate(recs) if is_finite(r.grad_norm) and (r.grad_norm or 0.0) > ceiling]
        flags += _episode_flags(
            "grad_norm_high", "warning", recs, high, breaks,
            lambda ep: (f"grad norm above {ceiling:g} at {_span(recs, ep)}, max "
                        f"{fmt(max(recs[i].grad_norm or 0.0 for i in ep))}",
                        max(recs[i].grad_norm or 0.0 for i in ep)))
    return flags


# --------------------------------------------------------------------------- throughput


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


def _throughput_flags(recs: Sequence[IterRecord], unit: Optional[str], th: Thresholds,
                      breaks: frozenset[int]) -> list[Flag]:
    """A drop is judged on the median of each 3 consecutive values (one slow iteration never crosses) against
    the median of the trailing window of normal values, and must last `throughput_min_records` records."""
    if unit is None or not 0 < th.throughput_drop < 1:
        return []
    ratio = 1.0 / (1.0 - th.throughput_drop)
    flags: list[Flag] = []
    for span in _attempt_slices(len(recs), breaks):
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


def _lr_flags(recs: Sequence[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    lrs = [(i, r.lr) for i, r in enumerate(recs) if r.lr is not None and math.isfinite(r.lr)]
    zero = [i for i, lr in lrs if lr == 0.0]
    flags = [f for f in _episode_flags(
        "lr_zero", "warning", recs, zero, breaks,
        lambda ep: (f"learning rate stuck at 0 at {_span(recs, ep)}: nothing is being learned", 0.0))
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


def _event_flags(recs: Sequence[IterRecord], events: Sequence[LogEvent]) -> list[Flag]:
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


# --------------------------------------------------------------------------- the whole analysis


def analyze(records: Sequence[IterRecord], th: Optional[Thresholds] = None, events: Sequence[LogEvent] = (),
            duplicates: int = 0, incomplete: int = 0) -> Analysis:
    """Summary and flags for parsed records (in log order) and the log's events. Pure; never raises."""
    th = th or Thresholds()
    # records built by hand (or by parse_line) may lack the number scan_log gives HF Trainer's lines
    recs = [r if r.iteration is not None else replace(r, iteration=n) for n, r in enumerate(records, 1)]
    breaks = attempt_starts(recs)
    key = primary_loss_key(recs)
    losses = [r.loss for r in recs if r.loss is not None and r.loss_key == key and math.isfinite(r.loss)]
    times = sorted(r.iter_time_s for r in recs if r.iter_time_s is not None and math.isfinite(r.iter_time_s))
    lrs = [r.lr for r in recs if r.lr is not None and math.isfinite(r.lr)]
    grads = [r.grad_norm for r in recs if r.grad_norm is not None and math.isfinite(r.grad_norm)]
    unit = throughput_unit(recs)
    costs = [c for r in recs if (c := cost(r, unit)) is not None]
    flags = (_nonfinite_flags(recs, key, breaks) + _skip_flags(recs, breaks)
             + _loss_spike_flags(recs, key, th, breaks) + _grad_flags(recs, th, breaks)
             + _throughput_flags(recs, unit, th, breaks) + _lr_flags(recs, th, breaks) + _event_flags(recs, events)
             + _overflow_streaks(recs, events, th) + _megatron_skip_streaks(recs, th, breaks))
    flags.sort(key=lambda f: (f.severity != "critical", f.line_no, f.kind))
    return Analysis(
        records=len(recs),
        first_iteration=recs[0].iteration if recs else None,
        last_iteration=recs[-1].iteration if recs else None,
        formats=sorted({r.fmt for r in recs}),
        loss_key=key,
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        loss_min=min(losses) if losses else None,
        iter_time_median_s=median(times) if times else None,
        iter_time_p95_s=percentile(times, 0.95) if times else None,
        throughput_unit=unit if costs else None,
        throughput_median=median(costs) if costs else None,
        lr_last=lrs[-1] if lrs else None,
        lr_max=max(lrs) if lrs else None,
        grad_norm_median=median(grads) if grads else None,
        grad_norm_max=max(grads) if grads else None,
        skipped_iterations=sum(r.skipped_iterations or 0 for r in recs),
        nan_iterations=sum(r.nan_iterations or 0 for r in recs),
        overflows=sum(1 for e in events if e.kind == "overflow"),
        duplicates=duplicates,
        incomplete=incomplete,
        restarts=[recs[i].iteration for i in sorted(breaks) if recs[i].iteration is not None],
        flags=flags,
    )
