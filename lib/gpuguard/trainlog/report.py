"""The human-readable summary of an `Analysis`."""

from __future__ import annotations

from gpuguard.trainlog.analysis import Analysis
from gpuguard.trainlog.judging import fmt


def format_summary(name: str, a: Analysis) -> str:
    if not a.records:  # the framework died before its first progress line, but said why
        return "\n".join([f"{name}: no training progress lines; {len(a.flags)} finding(s) from the framework's own "
                          "messages"] + [f"  {f.severity.upper():<8} {f.kind:<19} {f.message}" for f in a.flags])
    lines = [f"{name}: {a.records} logged iterations ({a.first_iteration} .. {a.last_iteration}), "
             f"format {'+'.join(a.formats) or '-'}",
             f"  loss        {fmt(a.loss_first)} -> {fmt(a.loss_last)} (min {fmt(a.loss_min)})"
             + (f" [{a.loss_key}]" if a.loss_key else ""),
             f"  iter time   median {fmt(a.iter_time_median_s)} s, p95 {fmt(a.iter_time_p95_s)} s"
             + (f"; {fmt(a.throughput_median)} {a.throughput_unit} median" if a.throughput_unit else ""),
             f"  lr          last {fmt(a.lr_last)} (max {fmt(a.lr_max)})",
             f"  grad norm   median {fmt(a.grad_norm_median)} (max {fmt(a.grad_norm_max)})"]
    if a.skipped_iterations or a.nan_iterations or a.overflows:
        lines.append(f"  skipped     {a.skipped_iterations} iterations, {a.nan_iterations} NaN iterations"
                     + (f", {a.overflows} fp16 overflow lines" if a.overflows else ""))
    if a.restarts:
        lines.append(f"  restarts    {len(a.restarts)} (resumed at iteration {', '.join(map(str, a.restarts))})")
    if a.incomplete:
        lines.append(f"  incomplete  {a.incomplete} progress line(s) cut short (a log being written, an excerpt): "
                     "not judged")
    if a.duplicates:
        lines.append(f"  duplicates  {a.duplicates} lines (other ranks' copies, progress-bar redraws) not counted")
    if not a.flags:
        lines.append("no problems found")
    else:
        lines.append(f"flags ({len(a.flags)}):")
        for f in a.flags:
            lines.append(f"  {f.severity.upper():<8} {f.kind:<19} {f.message}")
    return "\n".join(lines)
