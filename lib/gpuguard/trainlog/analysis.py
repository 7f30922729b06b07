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

Every trend restarts at a resumed attempt: the resumed run's loss level and speed are its own. The flags come from
gpuguard.trainlog.numeric_flags and gpuguard.trainlog.run_flags; thresholds and the flag type from
gpuguard.trainlog.judging."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from gpuguard.trainlog.judging import Flag, Thresholds, attempt_starts, primary_loss_key
from gpuguard.trainlog.numeric_flags import (grad_flags, loss_spike_flags, megatron_skip_streaks, nonfinite_flags,
                                             overflow_streaks, skip_flags)
from gpuguard.trainlog.records import IterRecord, LogEvent
from gpuguard.trainlog.run_flags import cost, event_flags, lr_flags, throughput_flags, throughput_unit
from gpuguard.trainlog.stats import median, percentile


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
    flags = (nonfinite_flags(recs, key, breaks) + skip_flags(recs, breaks)
             + loss_spike_flags(recs, key, th, breaks) + grad_flags(recs, th, breaks)
             + throughput_flags(recs, unit, th, breaks) + lr_flags(recs, th, breaks) + event_flags(recs, events)
             + overflow_streaks(recs, events, th) + megatron_skip_streaks(recs, th, breaks))
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
