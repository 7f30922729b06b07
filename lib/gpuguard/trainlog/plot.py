"""`--plot out.png`: four panels on one iteration axis -- loss, learning rate, grad norm (log scale), time per
sample/token/iteration -- with resumed attempts (dashed lines), skipped/NaN intervals (red crosses) and the
flags (shaded) marked. Needs matplotlib (`gpuguard[plot]`), imported only here."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from gpuguard.trainlog.analysis import Analysis
from gpuguard.trainlog.judging import attempt_starts, primary_loss_key
from gpuguard.trainlog.run_flags import cost
from gpuguard.trainlog.records import IterRecord

NAN = float("nan")
_PANEL_OF = {"nan_loss": 0, "loss_missing": 0, "loss_spike": 0, "nan_iterations": 0, "skipped_iterations": 0,
             "lr_zero": 1, "lr_stuck_max": 1, "grad_norm_spike": 2, "grad_norm_zero": 2, "grad_norm_high": 2,
             "grad_norm_nonfinite": 2, "throughput_drop": 3}


class PlotUnavailable(RuntimeError):
    pass


_PLOTTABLE = 1e100  # matplotlib's limit and tick arithmetic overflows near 1e300; no real metric is this large


def _finite(x: Optional[float], positive: bool = False) -> float:
    if x is None or not math.isfinite(x) or abs(x) > _PLOTTABLE or (positive and x <= 0):
        return NAN  # left out of the line; NaN/inf values are marked separately and flagged by the analysis
    return x


def _bad(r: IterRecord, key: Optional[str]) -> bool:
    """An interval that did not train normally: steps skipped, NaN iterations, a NaN or missing loss."""
    return bool(r.skipped_iterations or r.nan_iterations
                or any(not math.isfinite(v) for v in r.losses.values())
                or (r.fmt == "megatron" and (r.loss is None or r.loss_key != key)))


def _pyplot() -> Any:
    try:
        import matplotlib  # optional (gpuguard[plot]): only `--plot` needs it

        matplotlib.use("Agg")  # no display on a login or compute node
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib: pip install matplotlib (or gpuguard[plot]) ({e})") from None
    return plt


def plot(records: Sequence[IterRecord], analysis: Analysis, out_path: str, title: str = "") -> None:
    """Write the PNG."""
    plt = _pyplot()
    fig = figure(records, analysis, title)
    try:
        fig.savefig(out_path, dpi=100)
    finally:
        plt.close(fig)


def figure(records: Sequence[IterRecord], analysis: Analysis, title: str = "") -> Any:
    """The matplotlib Figure (4 axes sharing x). The caller closes it."""
    plt = _pyplot()
    recs = [r for r in records if r.iteration is not None and abs(r.iteration) <= 1e15]
    key = primary_loss_key(recs)
    unit = analysis.throughput_unit
    breaks = sorted(attempt_starts(recs))
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(11, 10))
    series = (  # (label, colour, the value as logged, whether only positive values can be drawn)
        ("loss" + (f" ({key})" if key else ""), "tab:blue", lambda r: r.loss if r.loss_key == key else None, False),
        ("learning rate", "tab:purple", lambda r: r.lr, False),
        ("grad norm (log)", "tab:orange", lambda r: r.grad_norm, True),
        (f"time ({unit})" if unit else "time", "tab:green", lambda r: cost(r, unit), False),
    )
    edges = [0, *breaks, len(recs)]
    for ax, (label, color, value, positive) in zip(axes, series):
        shown = False
        for a, b in zip(edges, edges[1:]):  # one line per attempt: a resumed run does not zigzag back
            xs = [recs[i].iteration for i in range(a, b)]
            ys = [_finite(value(recs[i]), positive) for i in range(a, b)]
            if any(not math.isnan(y) for y in ys):
                ax.plot(xs, ys, color=color, marker="." if len(xs) < 200 else None, markersize=3, linewidth=1)
                shown = True
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if not shown:
            logged = any(value(r) is not None for r in recs)
            ax.text(0.5, 0.5, "no finite value" if logged else "not in this log", transform=ax.transAxes,
                    ha="center", va="center", color="grey")
        elif positive:
            ax.set_yscale("log")
    _mark(axes, recs, key, breaks, analysis)
    axes[0].set_title(title or "training log")
    axes[-1].set_xlabel("logged record" if analysis.formats == ["hf"] else "iteration")
    fig.tight_layout()
    return fig


def _mark(axes: Any, recs: Sequence[IterRecord], key: Optional[str], breaks: Sequence[int],
          analysis: Analysis) -> None:
    for n, i in enumerate(breaks):
        for ax in axes:
            ax.axvline(recs[i].iteration, color="tab:purple", linestyle="--", linewidth=1,
                       label="restart (resumed attempt)" if n == 0 and ax is axes[0] else None)
        axes[0].annotate(f"resumed at {recs[i].iteration}", (recs[i].iteration, 0.5),
                         xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="center", ha="right",
                         color="tab:purple")
    bad = [r.iteration for r in recs if _bad(r, key)]
    if bad:
        axes[0].plot(bad, [0.04] * len(bad), "x", color="red", transform=axes[0].get_xaxis_transform(),
                     label="skipped / NaN interval")
    nonfinite = [r.iteration for r in recs if r.grad_norm is not None and not math.isfinite(r.grad_norm)]
    if nonfinite:
        axes[2].plot(nonfinite, [0.96] * len(nonfinite), "x", color="red", transform=axes[2].get_xaxis_transform(),
                     label="grad norm NaN/inf")
    for f in analysis.flags:
        if f.iteration is None:
            continue
        last = f.last_iteration if f.last_iteration is not None else f.iteration
        color = "red" if f.severity == "critical" else "orange"
        panels = [axes[_PANEL_OF[f.kind]]] if f.kind in _PANEL_OF else list(axes)
        for ax in panels:
            if last > f.iteration:
                ax.axvspan(f.iteration, last, color=color, alpha=0.2)
            else:
                ax.axvline(f.iteration, color=color, alpha=0.6, linewidth=2)
        panels[0].annotate(f.kind, (f.iteration, 0.98), xycoords=("data", "axes fraction"), rotation=90,
                           fontsize=7, va="top", ha="right", color=color)
    for ax in axes:
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="best", fontsize=8)
