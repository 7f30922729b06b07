"""`gpuguard trainlog FILE [--json] [--plot PNG]`: exit 0 no flags, 1 flags, 2 unreadable input / no training
lines / bad option. The file is read as a stream (a log of many GB costs memory for its records only)."""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Any, Iterable, Iterator

from gpuguard.trainlog.analysis import analyze
from gpuguard.trainlog.judging import Thresholds
from gpuguard.trainlog.parse import scan_log
from gpuguard.trainlog.plot import PlotUnavailable, plot
from gpuguard.trainlog.report import format_summary


class _ReadError(Exception):
    pass


class iter_lines:  # noqa: N801 - used like the generator it replaced
    """The file's lines (undecodable bytes replaced); `-` is stdin. An OSError, at open or mid-read, becomes
    _ReadError with a one-line reason. After iterating, `incomplete_last` says whether the last line had no
    newline: a log still being written ends mid-line, and scan_log does not judge that line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.incomplete_last = False

    def __iter__(self) -> Iterator[str]:
        try:
            if self.path == "-":
                yield from self._lines(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace",
                                                        newline="\n"))
                return
            with open(self.path, encoding="utf-8", errors="replace", newline="\n") as f:
                yield from self._lines(f)
        except OSError as e:
            raise _ReadError(e.strerror or str(e)) from None

    def _lines(self, stream: Iterable[str]) -> Iterator[str]:
        for line in stream:
            self.incomplete_last = not line.endswith("\n")
            yield line.rstrip("\n")


def read_lines(path: str) -> list[str]:
    try:
        return list(iter_lines(path))
    except _ReadError as e:
        raise OSError(str(e)) from None


_OPTIONS = {"grad_norm_max": "grad_norm_max", "spike_ratio": "spike_ratio", "grad_spike_k": "grad_spike_k",
            "throughput_drop": "throughput_drop"}


def thresholds_from_args(args: Any) -> Thresholds:
    """Thresholds with the command line's overrides; ValueError with the option's name when one is out of range."""
    th = Thresholds()
    for name, attr in _OPTIONS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if not value > 0 or (name == "throughput_drop" and not value < 1):
            rule = "between 0 and 1" if name == "throughput_drop" else "> 0"
            raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value:g}")
        setattr(th, attr, value)
    legacy = getattr(args, "time_spike_ratio", None)  # pre-0.x name: a time ratio r is a drop of 1 - 1/r
    if legacy is not None:
        if not legacy > 1:
            raise ValueError(f"--time-spike-ratio must be > 1, got {legacy:g}")
        th.throughput_drop = 1 - 1 / legacy
    return th


def main_from_args(args: Any) -> int:
    def fail(message: str) -> int:
        print(f"gpuguard trainlog: {message}", file=sys.stderr)
        return 2

    try:
        th = thresholds_from_args(args)
    except ValueError as e:
        return fail(str(e))
    try:
        log = scan_log(iter_lines(args.file))
    except _ReadError as e:
        return fail(f"cannot read {args.file}: {e}")
    if not log.records and not any(e.severity in ("critical", "warning") for e in log.events):
        return fail(f"no training progress lines in {args.file} (expected Megatron-LM, nanotron, torchtitan, "
                    "HF Trainer, Lightning or key=value lines such as 'step=10 loss=2.3')")
    result = analyze(log.records, th, log.events, log.duplicates, log.incomplete)
    if args.plot:
        try:
            plot(log.records, result, args.plot, title=args.file)
        except PlotUnavailable as e:
            return fail(str(e))
        except (OSError, ValueError) as e:
            return fail(f"cannot write the plot {args.plot}: {e}")
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


def add_parser(sub: Any) -> None:
    p = sub.add_parser("trainlog", help="analyse a training log (Megatron, nanotron, torchtitan, HF Trainer, "
                       "Lightning): NaN/missing loss, skipped steps, grad-norm spikes, throughput drops, lr")
    p.add_argument("file", help="log file ('-' for stdin)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="PNG", help="also draw loss, lr, grad norm and time per sample on one "
                   "iteration axis, restarts and skipped intervals marked (needs matplotlib)")
    p.add_argument("--grad-spike-k", type=float,
                   help="flag grad norm above the run's median + K x MAD of its trailing window (default 6)")
    p.add_argument("--grad-norm-max", type=float, help="also flag grad norm above this absolute value (default off)")
    p.add_argument("--spike-ratio", type=float, help="flag loss above this multiple of its recent trend (default 1.3)")
    p.add_argument("--throughput-drop", type=float, help="flag time per sample (token, iteration) staying this "
                   "fraction slower than before for 5+ records (default 0.2)")
    p.add_argument("--time-spike-ratio", type=float, help=argparse.SUPPRESS)  # old name: drop = 1 - 1/ratio


def run(args: Any) -> int:
    return main_from_args(args)
