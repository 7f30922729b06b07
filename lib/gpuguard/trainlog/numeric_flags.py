"""Flags about the numbers a training step produces (pure): non-finite losses and grad norms, skipped steps and
fp16 overflow streaks, loss spikes above their trend, grad-norm spikes against the run's own history."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from gpuguard.trainlog.judging import Flag, Thresholds, attempt_slices, episode_flags, fmt, span_text
from gpuguard.trainlog.records import IterRecord, LogEvent, is_finite
from gpuguard.trainlog.stats import mad, median


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


def nonfinite_flags(recs: Sequence[IterRecord], key: Optional[str], breaks: frozenset[int]) -> list[Flag]:
    flags: list[Flag] = []
    nan_loss = [i for i, r in enumerate(recs) if any(not math.isfinite(v) for v in r.losses.values())]

    def nan_message(ep: list[int]) -> tuple[str, Optional[float]]:
        r = recs[ep[0]]
        name, value = next((k, v) for k, v in r.losses.items() if not math.isfinite(v))
        return f"{name} is {value} at {span_text(recs, ep)}", value

    flags += episode_flags("nan_loss", "critical", recs, nan_loss, breaks, nan_message)

    missing = [i for i, r in enumerate(recs) if r.fmt == "megatron" and i not in nan_loss
               and (r.loss is None or (key is not None and r.loss_key != key))
               and not _all_skipped(recs, i, breaks) and not r.nan_iterations]
    flags += episode_flags(
        "loss_missing", "critical", recs, missing, breaks,
        lambda ep: (f"{key or 'lm loss'} absent at {span_text(recs, ep)}: Megatron prints a loss only when its "
                    "interval average is > 0, so a NaN loss leaves the line without one", None))

    nan_its = [i for i, r in enumerate(recs) if r.nan_iterations]
    flags += episode_flags(
        "nan_iterations", "critical", recs, nan_its, breaks,
        lambda ep: (f"{sum(recs[i].nan_iterations or 0 for i in ep)} NaN iteration(s) reported (Megatron's "
                    f"\"number of nan iterations\") at {span_text(recs, ep)}", float(recs[ep[0]].nan_iterations or 0)))

    bad_grad = [i for i, r in enumerate(recs) if r.grad_norm is not None and not math.isfinite(r.grad_norm)]
    flags += episode_flags(
        "grad_norm_nonfinite", "critical", recs, bad_grad, breaks,
        lambda ep: (f"grad norm is {recs[ep[0]].grad_norm} at {span_text(recs, ep)}", recs[ep[0]].grad_norm))
    return flags


def skip_flags(recs: Sequence[IterRecord], breaks: frozenset[int]) -> list[Flag]:
    """fp16 dynamic loss scaling skips a step and halves the scale on overflow: while it calibrates at the start
    of an attempt, and now and then afterwards, that is normal. It is not once training is under way and a
    whole log interval was skipped, nor when the scale is already down to 1 (nothing left to back off)."""
    hits = []
    for span in attempt_slices(len(recs), breaks):
        started = False
        for i in span:
            r = recs[i]
            overflows = (r.skipped_iterations or 0) - (r.nan_iterations or 0)  # NaN ones are flagged as such
            if overflows > 0 and ((r.loss_scale is not None and r.loss_scale <= 1.0)
                                  or (started and _all_skipped(recs, i, breaks))):
                hits.append(i)
            started = started or r.loss is not None
    return episode_flags(
        "skipped_iterations", "critical", recs, hits, breaks,
        lambda ep: (f"{sum(recs[i].skipped_iterations or 0 for i in ep)} optimizer step(s) skipped at "
                    f"{span_text(recs, ep)} (loss scale {fmt(recs[ep[-1]].loss_scale)}): overflowing gradients the "
                    "loss scaler cannot absorb", float(recs[ep[0]].skipped_iterations or 0)))


WARMUP_MIN_SCALE = 1024.0  # fp16 loss scalers start at 2^16 (DeepSpeed's default) or higher, never this low


def overflow_streaks(recs: Sequence[IterRecord], events: Sequence[LogEvent], th: Thresholds) -> list[Flag]:
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


def megatron_skip_streaks(recs: Sequence[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    """Megatron logs how many steps of each interval were skipped: consecutive intervals with skips, the loss
    scale falling, `skip_streak` or more in all, once training is under way (whole skipped intervals are
    `skipped_iterations` already)."""
    hits: list[list[int]] = []
    for span in attempt_slices(len(recs), breaks):
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
                 f"intervals at {span_text(recs, run)}, loss scale falling to {fmt(recs[run[-1]].loss_scale)}: "
                 "overflowing gradients the loss scaler cannot absorb",
                 float(sum(recs[j].skipped_iterations or 0 for j in run)), recs[run[0]].line_no, len(run))
            for run in hits]


# --------------------------------------------------------------------------- loss and grad-norm spikes


def loss_spike_flags(recs: Sequence[IterRecord], key: Optional[str], th: Thresholds,
                      breaks: frozenset[int]) -> list[Flag]:
    hits: list[int] = []
    trend_at: dict[int, float] = {}
    for span in attempt_slices(len(recs), breaks):
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
        return (f"loss spike at {span_text(recs, ep)}: peak {fmt(peak)} at iteration {recs[peak_i].iteration} vs "
                f"trend {fmt(trend)}{ratio}", peak)

    return episode_flags("loss_spike", "warning", recs, hits, breaks, describe)


def grad_flags(recs: Sequence[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    flags: list[Flag] = []
    hits: list[int] = []
    base_at: dict[int, tuple[float, float]] = {}
    for span in attempt_slices(len(recs), breaks):
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
            return (f"grad norm spike at {span_text(recs, ep)}: peak {fmt(peak)} at iteration {recs[peak_i].iteration}, "
                    f"{peak / med:.0f}x the run's first grad norms (median {fmt(med)}; limit "
                    f"{th.grad_ceiling_ratio:g}x)", peak)
        return (f"grad norm spike at {span_text(recs, ep)}: peak {fmt(peak)} at iteration {recs[peak_i].iteration} vs "
                f"the run's median {fmt(med)} (limit median + {th.grad_spike_k:g} MAD = {fmt(limit)})", peak)

    flags += episode_flags("grad_norm_spike", "warning", recs, hits, breaks, spike)

    zero = [i for i, r in enumerate(recs) if r.grad_norm == 0.0]
    everywhere = len(zero) == sum(1 for r in recs if r.grad_norm is not None)
    flags += episode_flags(
        "grad_norm_zero", "warning", recs, zero, breaks,
        lambda ep: (f"grad norm exactly 0 at {span_text(recs, ep)}"
                    + (": on every line, so this setup does not report it (DeepSpeed pipeline parallelism logs "
                       "0.000) or no gradient flows" if everywhere else ": no gradient reached the optimizer"),
                    0.0))
    if th.grad_norm_max is not None:
        ceiling = th.grad_norm_max
        high = [i for i, r in enumerate(recs) if is_finite(r.grad_norm) and (r.grad_norm or 0.0) > ceiling]
        flags += episode_flags(
            "grad_norm_high", "warning", recs, high, breaks,
            lambda ep: (f"grad norm above {ceiling:g} at {span_text(recs, ep)}, max "
                        f"{fmt(max(recs[i].grad_norm or 0.0 for i in ep))}",
                        max(recs[i].grad_norm or 0.0 for i in ep)))
    return flags
