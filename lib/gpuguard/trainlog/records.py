"""What the parsers produce: one `IterRecord` per logged training interval, one `LogEvent` per other line that
matters (a framework's NaN check firing, a checkpoint resume), and the number readers they share. Pure."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class IterRecord:
    """One training-progress line. `iteration` is the framework's own step counter; it is None only from the
    stateless `parse_line` on formats that print none (HF Trainer's dict lines): `scan_log` numbers those."""

    iteration: Optional[int]
    line_no: int = 0
    fmt: str = "megatron"  # megatron | nanotron | torchtitan | hf | lightning | kv
    total: Optional[int] = None  # the run's planned iterations, when the line says
    loss: Optional[float] = None  # the primary training loss ("lm loss", "loss", ...); None when not printed
    loss_key: Optional[str] = None
    losses: dict[str, float] = field(default_factory=dict)  # every "*loss" value on the line
    lr: Optional[float] = None
    grad_norm: Optional[float] = None
    iter_time_s: Optional[float] = None  # wall time per iteration
    batch_size: Optional[int] = None  # samples per iteration (global batch size), when the line says
    tokens_per_s: Optional[float] = None  # throughput the framework computed itself (per GPU for torchtitan)
    loss_scale: Optional[float] = None
    skipped_iterations: Optional[int] = None  # Megatron: optimizer steps skipped in this interval
    nan_iterations: Optional[int] = None  # Megatron: skipped iterations whose loss was NaN/inf
    epoch: Optional[float] = None  # HF Trainer / Lightning
    timestamp: Optional[str] = None
    source: str = ""  # rank tag in front of the line ("rank 0" from "[rank0]:", "[default0]:" or srun's "0: ")
    attempt: int = 0  # 0 for the first attempt in the log, +1 at each resume (set by scan_log)


@dataclass
class LogEvent:
    """A non-iteration line a person must see (`severity` critical | warning | info) or a resume marker
    (`kind` "resume": a new attempt starts; `iteration` is where it resumed, when the line says)."""

    kind: str  # nan_check | rerun_diagnosis | loss_scale_min | overflow | resume
    severity: str
    line_no: int
    message: str
    iteration: Optional[int] = None
    node: Optional[str] = None  # the node the framework named (Megatron's checks name rank, node and device)
    rank: Optional[int] = None
    detail: str = ""  # the framework's own message without rank/node, so one fault on 64 ranks is one finding
    scale_from: Optional[float] = None  # DeepSpeed overflow: the loss scale it attempted
    scale_to: Optional[float] = None    # ... and the one it reduced to (None: only its hysteresis went down)


_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|infinity)$", re.IGNORECASE)
_HUMAN = re.compile(r"^([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf))([KMGBTPE]?)$", re.IGNORECASE)
_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_MAX_INT = 10 ** 15  # iteration counters beyond this are garbage, not a training run


def parse_float(text: str) -> Optional[float]:
    """'1.072453E+01' -> 10.72; 'NAN' / 'nan' / '-INF' -> non-finite floats; '1,234' -> 1234; else None."""
    text = text.strip().rstrip("|,").strip().replace(",", "")
    if not text or len(text) > 64 or not _NUMBER.match(text):
        return None
    try:
        return float(text)
    except (ValueError, OverflowError):
        return None


def parse_human(text: str) -> Optional[float]:
    """nanotron's human_format: '11.5K' -> 11500.0, '85.8G' / '85.8B' -> 8.58e10, '1e-05' -> 1e-05."""
    text = text.strip()
    m = _HUMAN.match(text) if len(text) <= 64 else None
    if not m:
        return None
    value = parse_float(m.group(1))
    if value is None:
        return None
    return value * _SCALE[m.group(2).upper()]


def parse_int(text: str) -> Optional[int]:
    """'  6' -> 6; anything not a plain non-negative integer of sane size -> None."""
    text = text.strip().replace(",", "")
    if not text.isdigit() or len(text) > 15:
        return None
    value = int(text)
    return value if value < _MAX_INT else None


def with_unit(text: str, default_ms: bool) -> Optional[float]:
    """'0.51s' / '510ms' / '0.51' -> seconds."""
    m = re.match(r"^([-+0-9.eE]+|nan|inf)(ms|s)?$", text.strip(), re.IGNORECASE)
    if not m:
        return None
    value = parse_float(m.group(1))
    if value is None:
        return None
    unit = (m.group(2) or ("ms" if default_ms else "s")).lower()
    return value / 1000.0 if unit == "ms" else value


def is_finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)
