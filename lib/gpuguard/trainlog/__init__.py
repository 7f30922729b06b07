"""Training-log analysis: `gpuguard trainlog FILE [--json] [--plot out.png]`, and the parser the job monitor
uses to follow a training log (`parse_line`).

Reads the progress lines of Megatron-LM / Megatron-DeepSpeed, nanotron, torchtitan, the Hugging Face Trainer,
PyTorch Lightning's progress bar and a simple key=value form (`formats`), the frameworks' own NaN/Inf checks and
resume markers (`events`), splits the log into attempts and one rank's copy (`parse`), and judges it (`analysis`):
NaN/missing losses, NaN iterations, skipped steps, grad-norm spikes against the run's own median, sustained
throughput drops per sample, loss spikes, learning-rate faults. `plot` draws it; `cli` is the command.
"""

from gpuguard.trainlog.analysis import Analysis, analyze
from gpuguard.trainlog.cli import main_from_args, read_lines
from gpuguard.trainlog.judging import Flag, Thresholds
from gpuguard.trainlog.parse import TrainLog, parse_line, parse_log, scan_log
from gpuguard.trainlog.plot import PlotUnavailable, plot
from gpuguard.trainlog.records import IterRecord, LogEvent, parse_float
from gpuguard.trainlog.report import format_summary

__all__ = ["Analysis", "Flag", "IterRecord", "LogEvent", "PlotUnavailable", "Thresholds", "TrainLog", "analyze",
           "format_summary", "main_from_args", "parse_float", "parse_line", "parse_log", "plot", "read_lines",
           "scan_log"]
