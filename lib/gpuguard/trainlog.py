"""Training-log analysis: `gpuguard trainlog FILE [--json] [--plot out.png]`.

Parses Megatron-LM / Megatron-DeepSpeed iteration lines, e.g. (Megatron's `training_log`)

     [2025-04-13 23:41:20] iteration       20/    1000 | consumed samples:          320 | elapsed time per
     iteration (ms): 820.7 | learning rate: 4.000000E-05 | global batch size:    16 | lm loss: 1.072453E+01 |
     loss scale: 131072.0 | grad norm: 3.874 | number of skipped iterations:   6 | number of nan iterations:   0 |

with any prefix in front (`[default3]:` from torchrun, `7: ` from `srun -l`), the DeepSpeed variant
(`elapsed time per iteration (s)`), the older colon-less keys (`lm loss 6.5E+00 |`), and a simple key=value form
(`step=120 loss=2.31 grad_norm=0.9 lr=3e-4 step_time=0.51`). Megatron formats a NaN loss with `{:.6E}`, which
prints `NAN`/`INF`: those parse as non-finite floats, never as garbage.

`parse_line` and `analyze` are pure; the monitor uses `parse_line` for progress detection.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

# --------------------------------------------------------------------------- records


@dataclass
class IterRecord:
    iteration: int
    line_no: int = 0
    fmt: str = "megatron"  # megatron | kv
    total: Optional[int] = None
    loss: Optional[float] = None  # the primary loss ("lm loss", else the first "* loss")
    losses: dict[str, float] = field(default_factory=dict)
    lr: Optional[float] = None
    grad_norm: Optional[float] = None
    iter_time_s: Optional[float] = None
    skipped_iterations: Optional[int] = None
    nan_iterations: Optional[int] = None
    timestamp: Optional[str] = None


_MEGATRON = re.compile(r"(?:^|[\s\]|:])iteration\s+(\d+)\s*/\s*(\d+|infinity)\s*\|(.*)$", re.IGNORECASE)
_TIMESTAMP = re.compile(r"\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)\]")
_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|infinity)$", re.IGNORECASE)
_KV = re.compile(r"(?<![\w./-])([A-Za-z_][\w./-]*)=([^\s,;|]+)")

# key=value aliases -> field
_KV_ITERATION = ("step", "iter", "iteration", "global_step", "train/global_step")
_KV_LOSS = ("loss", "lm_loss", "train_loss", "train/loss")
_KV_GRAD = ("grad_norm", "gnorm", "grad-norm", "train/grad_norm")
_KV_LR = ("lr", "learning_rate", "train/learning_rate")
_KV_TIME_S = ("step_time", "iter_time", "dt", "step_time_s", "iter_time_s", "time_per_step")
_KV_TIME_MS = ("step_time_ms", "iter_time_ms", "time_ms", "elapsed_ms")


def parse_float(text: str) -> Optional[float]:
    """'1.072453E+01' -> 10.72; 'NAN' / 'nan' / '-INF' -> non-finite floats; anything else -> None."""
    text = text.strip().rstrip("|").strip()
    if not _NUMBER.match(text):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _with_unit(text: str, default_ms: bool) -> Optional[float]:
    """'0.51s' / '510ms' / '0.51' -> seconds."""
    m = re.match(r"^([-+0-9.eE]+|nan|inf)(ms|s)?$", text.strip(), re.IGNORECASE)
    if not m:
        return None
    value = parse_float(m.group(1))
    if value is None:
        return None
    unit = (m.group(2) or ("ms" if default_ms else "s")).lower()
    return value / 1000.0 if unit == "ms" else value


def _megatron_pairs(rest: str) -> list[tuple[str, str]]:
    """'a: 1 | b c: 2 |' -> [('a', '1'), ('b c', '2')]; the colon-less older form 'lm loss 6.5E+00' too."""
    pairs = []
    for part in rest.split("|"):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            key, _, value = part.rpartition(":")
        else:
            key, _, value = part.rpartition(" ")
        pairs.append((key.strip().lower(), value.strip()))
    return pairs


def _parse_megatron(m: re.Match[str], line: str, line_no: int) -> IterRecord:
    rec = IterRecord(iteration=int(m.group(1)), line_no=line_no, fmt="megatron",
                     total=None if m.group(2).lower() == "infinity" else int(m.group(2)))
    ts = _TIMESTAMP.search(line[: m.start() + 1])
    rec.timestamp = ts.group(1) if ts else None
    for key, value in _megatron_pairs(m.group(3)):
        if key.startswith("elapsed time per iteration"):
            number = parse_float(value)
            if number is not None:
                rec.iter_time_s = number / 1000.0 if "(ms)" in key else number
        elif key in ("learning rate", "lr"):
            rec.lr = parse_float(value)
        elif key == "grad norm":
            rec.grad_norm = parse_float(value)
        elif key == "number of skipped iterations":
            number = parse_float(value)
            rec.skipped_iterations = int(number) if number is not None and math.isfinite(number) else None
        elif key == "number of nan iterations":
            number = parse_float(value)
            rec.nan_iterations = int(number) if number is not None and math.isfinite(number) else None
        elif (key.endswith("loss") or key.endswith("_loss")) and key != "loss scale":
            number = parse_float(value)
            if number is not None:
                rec.losses[key] = number
    if rec.losses:
        rec.loss = rec.losses.get("lm loss", rec.losses.get("lm_loss", next(iter(rec.losses.values()))))
    return rec


def _parse_kv(line: str, line_no: int) -> Optional[IterRecord]:
    pairs = {k.lower(): v for k, v in _KV.findall(line)}
    it_key = next((k for k in _KV_ITERATION if k in pairs), None)
    if it_key is None:
        return None
    try:
        iteration = int(pairs[it_key])
    except ValueError:
        return None
    rec = IterRecord(iteration=iteration, line_no=line_no, fmt="kv")
    for key in _KV_LOSS:
        if key in pairs and (v := parse_float(pairs[key])) is not None:
            rec.losses[key] = v
    rec.loss = next(iter(rec.losses.values()), None)
    rec.grad_norm = next((v for k in _KV_GRAD if k in pairs and (v := parse_float(pairs[k])) is not None), None)
    rec.lr = next((v for k in _KV_LR if k in pairs and (v := parse_float(pairs[k])) is not None), None)
    for keys, default_ms in ((_KV_TIME_MS, True), (_KV_TIME_S, False)):
        for key in keys:
            if key in pairs and (v := _with_unit(pairs[key], default_ms)) is not None:
                rec.iter_time_s = v
                break
    # a lone `step=3` in some unrelated line is not a training record
    if rec.loss is None and rec.grad_norm is None and rec.lr is None and rec.iter_time_s is None:
        return None
    return rec


def parse_line(line: str, line_no: int = 0) -> Optional[IterRecord]:
    """One log line -> an IterRecord, or None when it is not a training-iteration line. Never raises."""
    if "iteration" in line.lower():
        m = _MEGATRON.search(line)
        if m:
            return _parse_megatron(m, line, line_no)
    if "=" in line:
        return _parse_kv(line, line_no)
    return None


def parse_log(lines: Iterable[str]) -> list[IterRecord]:
    out = []
    for n, line in enumerate(lines, 1):
        rec = parse_line(line, n)
        if rec is not None:
            out.append(rec)
    return out


# --------------------------------------------------------------------------- analysis


@dataclass
class Thresholds:
    grad_norm_max: float = 100.0
    spike_ratio: float = 1.3  # loss above this multiple of its trend (median of the last `window` good losses)
    spike_min_delta: float = 0.1  # ... and at least this much above it (noise near 0 is not a spike)
    time_spike_ratio: float = 2.0
    window: int = 20
    min_history: int = 2  # finite losses / times needed before a spike can be judged
    lr_zero_records: int = 3  # lr exactly 0 this many records in a row (one record at warm-up start is normal)
    lr_max_records: int = 20  # lr pinned at its peak for the last this-many records after a warm-up: no decay?


@dataclass
class Flag:
    kind: str  # nan_loss | loss_spike | grad_norm_high | grad_norm_zero | iter_time_spike | lr_zero | lr_stuck_max
    severity: str  # critical | warning
    iteration: int  # first iteration concerned
    last_iteration: int
    message: str
    value: Optional[float] = None
    line_no: int = 0  # log line of the first record concerned


@dataclass
class Analysis:
    records: int
    first_iteration: Optional[int]
    last_iteration: Optional[int]
    formats: list[str]
    loss_first: Optional[float]
    loss_last: Optional[float]
    loss_min: Optional[float]
    iter_time_median_s: Optional[float]
    iter_time_p95_s: Optional[float]
    lr_last: Optional[float]
    lr_max: Optional[float]
    grad_norm_median: Optional[float]
    grad_norm_max: Optional[float]
    restarts: list[int] = field(default_factory=list)  # iteration each resumed attempt started at
    flags: list[Flag] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))


def _json_safe(obj: Any) -> Any:
    """JSON has no NaN/inf: spell them as strings so `--json` output is valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def restarts(recs: list[IterRecord]) -> list[int]:
    """Indices of records whose iteration went backwards: the job resumed from an older checkpoint (a requeued
    job appends to the same log with --open-mode=append)."""
    return [i for i in range(1, len(recs)) if recs[i].iteration < recs[i - 1].iteration]


def _episodes(hits: list[tuple[int, float]], breaks: frozenset[int] = frozenset()) -> list[list[tuple[int, float]]]:
    """Group (record index, value) hits that follow each other into episodes (never across a restart)."""
    groups: list[list[tuple[int, float]]] = []
    for idx, value in hits:
        if groups and idx == groups[-1][-1][0] + 1 and idx not in breaks:
            groups[-1].append((idx, value))
        else:
            groups.append([(idx, value)])
    return groups


def _nan_flags(recs: list[IterRecord]) -> list[Flag]:
    flags = []
    for r in recs:
        bad = {k: v for k, v in r.losses.items() if not math.isfinite(v)}
        if bad:
            key, value = next(iter(bad.items()))
            flags.append(Flag("nan_loss", "critical", r.iteration, r.iteration,
                              f"{key} is {value} at iteration {r.iteration}", value, r.line_no))
        elif r.nan_iterations:
            flags.append(Flag("nan_loss", "critical", r.iteration, r.iteration,
                              f"{r.nan_iterations} NaN iteration(s) reported in the interval ending at iteration "
                              f"{r.iteration}", float(r.nan_iterations), r.line_no))
    return flags


def _spike_flags(recs: list[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    good: list[float] = []  # recent losses that were neither NaN nor part of a spike: the trend
    hits: list[tuple[int, float]] = []
    trend_at: dict[int, float] = {}
    for i, r in enumerate(recs):
        if i in breaks:
            good = []  # resumed from a checkpoint: the loss level is that checkpoint's
        if r.loss is None or not math.isfinite(r.loss):
            continue
        if len(good) >= th.min_history:
            trend = statistics.median(good[-th.window:])
            if r.loss > trend * th.spike_ratio and r.loss - trend >= th.spike_min_delta:
                hits.append((i, r.loss))
                trend_at[i] = trend
                continue
        good.append(r.loss)
    flags = []
    for ep in _episodes(hits, breaks):
        peak_i, peak = max(ep, key=lambda h: h[1])
        trend = trend_at[ep[0][0]]
        first, last = recs[ep[0][0]].iteration, recs[ep[-1][0]].iteration
        span = f"iteration {first}" if first == last else f"iterations {first}-{last}"
        flags.append(Flag("loss_spike", "warning", first, last,
                          f"loss spike at {span}: peak {_fmt(peak)} at iteration {recs[peak_i].iteration} vs trend "
                          f"{_fmt(trend)} ({peak / trend:.2f}x)", peak, recs[ep[0][0]].line_no))
    return flags


def _grad_flags(recs: list[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    flags = []
    idx = [(i, r.grad_norm) for i, r in enumerate(recs) if r.grad_norm is not None]
    for kind, test, what in (("grad_norm_high", lambda g: not math.isfinite(g) or g > th.grad_norm_max,
                              f"above {th.grad_norm_max:g}"),
                             ("grad_norm_zero", lambda g: g == 0.0, "exactly 0")):
        hits = [(i, g) for i, g in idx if test(g)]
        for ep in _episodes(hits, breaks):
            first, last = recs[ep[0][0]].iteration, recs[ep[-1][0]].iteration
            worst_i, worst = max(ep, key=lambda h: h[1] if math.isfinite(h[1]) else math.inf)
            span = f"iteration {first}" if first == last else f"iterations {first}-{last} ({len(ep)} records)"
            detail = f", max {_fmt(worst)} at iteration {recs[worst_i].iteration}" if kind == "grad_norm_high" else ""
            flags.append(Flag(kind, "warning", first, last, f"grad norm {what} at {span}{detail}", worst,
                              recs[ep[0][0]].line_no))
    return flags


def _time_flags(recs: list[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    seen: list[float] = []
    hits: list[tuple[int, float]] = []
    base_at: dict[int, float] = {}
    for i, r in enumerate(recs):
        if i in breaks:
            seen = []
        t = r.iter_time_s
        if t is None or not math.isfinite(t) or t <= 0:
            continue
        if len(seen) >= th.min_history:
            base = statistics.median(seen[-th.window:])
            if t > base * th.time_spike_ratio:
                hits.append((i, t))
                base_at[i] = base
                continue
        seen.append(t)
    flags = []
    for ep in _episodes(hits, breaks):
        peak_i, peak = max(ep, key=lambda h: h[1])
        base = base_at[ep[0][0]]
        first, last = recs[ep[0][0]].iteration, recs[ep[-1][0]].iteration
        span = f"iteration {first}" if first == last else f"iterations {first}-{last}"
        flags.append(Flag("iter_time_spike", "warning", first, last,
                          f"iteration time spike at {span}: {peak:.3g} s vs median {base:.3g} s "
                          f"({peak / base:.1f}x)", peak, recs[ep[0][0]].line_no))
    return flags


def _lr_flags(recs: list[IterRecord], th: Thresholds, breaks: frozenset[int]) -> list[Flag]:
    lrs = [(i, r.lr) for i, r in enumerate(recs) if r.lr is not None and math.isfinite(r.lr)]
    flags = []
    for ep in _episodes([(i, lr) for i, lr in lrs if lr == 0.0], breaks):
        if len(ep) >= th.lr_zero_records:
            first, last = recs[ep[0][0]].iteration, recs[ep[-1][0]].iteration
            flags.append(Flag("lr_zero", "warning", first, last,
                              f"learning rate stuck at 0 for {len(ep)} records (iterations {first}-{last}): "
                              "nothing is being learned", 0.0, recs[ep[0][0]].line_no))
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
                              recs[tail[0][0]].line_no))
    return flags


def analyze(records: list[IterRecord], th: Optional[Thresholds] = None) -> Analysis:
    """Summary and flags for parsed records (in log order). Pure."""
    th = th or Thresholds()
    finite_losses = [r.loss for r in records if r.loss is not None and math.isfinite(r.loss)]
    times = sorted(r.iter_time_s for r in records if r.iter_time_s is not None and math.isfinite(r.iter_time_s))
    lrs = [r.lr for r in records if r.lr is not None and math.isfinite(r.lr)]
    grads = [r.grad_norm for r in records if r.grad_norm is not None and math.isfinite(r.grad_norm)]
    breaks = frozenset(restarts(records))
    flags = _nan_flags(records) + _spike_flags(records, th, breaks) + _grad_flags(records, th, breaks) \
        + _time_flags(records, th, breaks) + _lr_flags(records, th, breaks)
    flags.sort(key=lambda f: (f.line_no, f.kind))
    return Analysis(
        records=len(records),
        first_iteration=records[0].iteration if records else None,
        last_iteration=records[-1].iteration if records else None,
        formats=sorted({r.fmt for r in records}),
        loss_first=finite_losses[0] if finite_losses else None,
        loss_last=finite_losses[-1] if finite_losses else None,
        loss_min=min(finite_losses) if finite_losses else None,
        iter_time_median_s=statistics.median(times) if times else None,
        iter_time_p95_s=times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))] if times else None,
        lr_last=lrs[-1] if lrs else None,
        lr_max=max(lrs) if lrs else None,
        grad_norm_median=statistics.median(grads) if grads else None,
        grad_norm_max=max(grads) if grads else None,
        restarts=[records[i].iteration for i in sorted(breaks)],
        flags=flags,
    )


def format_summary(name: str, a: Analysis) -> str:
    lines = [f"{name}: {a.records} logged iterations ({a.first_iteration} .. {a.last_iteration}), "
             f"format {'+'.join(a.formats)}",
             f"  loss        {_fmt(a.loss_first)} -> {_fmt(a.loss_last)} (min {_fmt(a.loss_min)})",
             f"  iter time   median {_fmt(a.iter_time_median_s)} s, p95 {_fmt(a.iter_time_p95_s)} s",
             f"  lr          last {_fmt(a.lr_last)} (max {_fmt(a.lr_max)})",
             f"  grad norm   median {_fmt(a.grad_norm_median)} (max {_fmt(a.grad_norm_max)})"]
    if a.restarts:
        lines.append(f"  restarts    {len(a.restarts)} (resumed at iteration {', '.join(map(str, a.restarts))})")
    if not a.flags:
        lines.append("no problems found")
    else:
        lines.append(f"flags ({len(a.flags)}):")
        for f in a.flags:
            lines.append(f"  {f.severity.upper():<8} {f.kind:<15} {f.message}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot (optional matplotlib)


class PlotUnavailable(RuntimeError):
    pass


def plot(records: list[IterRecord], analysis: Analysis, out_path: str, title: str = "") -> None:
    """PNG of loss (flags marked) and iteration time over iterations. Needs matplotlib (`gpuguard[plot]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a login or compute node
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib: pip install matplotlib (or gpuguard[plot]) ({e})") from None
    its = [r.iteration for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    ax1.plot(its, [r.loss if r.loss is not None and math.isfinite(r.loss) else float("nan") for r in records],
             label="loss", color="tab:blue")
    for f in analysis.flags:
        color = "red" if f.severity == "critical" else "orange"
        ax1.axvspan(f.iteration - 0.5, f.last_iteration + 0.5, color=color, alpha=0.25)
        ax1.annotate(f.kind, (f.iteration, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                     va="top", color=color)
    ax1.set_ylabel("loss")
    ax1.set_title(title or "training log")
    ax1.legend(loc="upper right")
    ax2.plot(its, [r.iter_time_s if r.iter_time_s is not None else float("nan") for r in records],
             color="tab:green")
    ax2.set_ylabel("iteration time (s)")
    ax2.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def main_from_args(args: Any) -> int:
    """0: no problems, 1: flags raised, 2: unreadable file / no iteration lines / plot impossible."""
    import json

    try:
        lines = read_lines(args.file)
    except OSError as e:
        print(f"gpuguard trainlog: cannot read {args.file}: {e.strerror or e}", file=sys.stderr)
        return 2
    records = parse_log(lines)
    if not records:
        print(f"gpuguard trainlog: no training iteration lines in {args.file} (expected Megatron "
              "' iteration N/ M | ...' lines or key=value lines such as 'step=10 loss=2.3')", file=sys.stderr)
        return 2
    th = Thresholds()
    for name in ("grad_norm_max", "spike_ratio", "time_spike_ratio"):
        value = getattr(args, name, None)
        if value is not None:
            if value <= 0:
                print(f"gpuguard trainlog: --{name.replace('_', '-')} must be > 0, got {value:g}", file=sys.stderr)
                return 2
            setattr(th, name, value)
    result = analyze(records, th)
    if args.plot:
        try:
            plot(records, result, args.plot, title=args.file)
        except PlotUnavailable as e:
            print(f"gpuguard trainlog: {e}", file=sys.stderr)
            return 2
    if args.json:
        out = result.to_dict()
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out, indent=2))
    else:
        print(format_summary(args.file, result))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 1 if result.flags else 0
