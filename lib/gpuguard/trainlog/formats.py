"""One pure parser per training framework's progress line. Each takes one logical line (ANSI colours already
stripped, one `\\r` segment) and returns an `IterRecord` or None. The formats, from each project's source:

* Megatron-LM `megatron/training/training.py::training_log` (and Megatron-DeepSpeed's copy):
  ``' [%Y-%m-%d %H:%M:%S.%f] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms):
  {:.1f} | learning rate: {:.6E} | global batch size: {:5d} | {key}: {:.6E} | loss scale: {:.1f} | grad norm:
  {:.3f} | number of skipped iterations: {:3d} | number of nan iterations: {:3d} |'``. A loss is printed only
  `if avg > 0.0` (`>= 0.0` in newer releases): a NaN average fails that test, so **a NaN loss is simply absent**
  from the line; with every iteration of the interval skipped the average is 0 (omitted, or `0.000000E+00`).
* nanotron `trainer.py` log entries: ``'iteration: 991 / 1000 | consumed_tokens: 634K |
  elapsed_time_per_iteration_ms: 272 | ... | global_batch_size: 20 | lm_loss: 9.63 | lr: 1e-05 | ... |
  grad_norm: 1.11'``, numbers in nanotron's `human_format` (3 significant digits, K/M/G/B/T suffixes).
* torchtitan `components/metrics.py`: ``'step: {step:2}  loss: {loss:7.4f}  grad_norm: {grad_norm:7.4f}  memory:
  ...GiB(...%)  tps: {round(tps):,}  tflops: ...  mfu: ...%'`` (coloured; tps is tokens/s per device).
* Hugging Face Trainer `ProgressCallback.on_log`: ``str(logs)``, e.g. ``{'loss': 2.119, 'grad_norm': 37.65,
  'learning_rate': 4.58e-05, 'epoch': 0.25}``: no step number (`scan_log` numbers them).
* PyTorch Lightning's TQDM progress bar: ``'Epoch 0:  22%|██▏       | 4/18 [00:17<01:02,  4.47s/it, loss=10.07,
  v_num=193315]'`` (or without the bar in notebooks: ``'Epoch 0:  97% 1651/1702 [13:00<00:24,  2.11it/s, ...]'``).
* a simple key=value form for anything else: ``step=120 loss=2.31 grad_norm=0.9 lr=3e-4 step_time=0.51s``.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Optional

from gpuguard.trainlog.records import IterRecord, parse_float, parse_human, parse_int, with_unit

# Primary-loss names in order of preference; anything else ending in "loss" is kept in `losses` only.
PRIMARY_LOSS_KEYS = ("lm loss", "lm_loss", "loss", "train_loss", "train/loss", "loss_step", "train_loss_step",
                     "train/loss_step", "loss_epoch", "train_loss_epoch")
_AUX_LOSS = re.compile(r"balancing|z_loss|aux|mtp|indexer|valid|eval|val_|val/", re.IGNORECASE)


def _set_losses(rec: IterRecord, losses: dict[str, float]) -> None:
    rec.losses = losses
    key = next((k for k in PRIMARY_LOSS_KEYS if k in losses), None)
    if key is None:  # a custom name ("my loss"), but never an auxiliary loss standing in for a missing one
        key = next((k for k in losses if not _AUX_LOSS.search(k)), None)
    rec.loss_key = key
    rec.loss = losses[key] if key is not None else None


# --------------------------------------------------------------------------- Megatron-LM / Megatron-DeepSpeed

_MEGATRON = re.compile(r"(?:^|[\s\]|:])iteration\s+(\d{1,15})\s*/\s*(\d{1,15}|infinity)\s*\|(.*)$", re.IGNORECASE)
_TIMESTAMP = re.compile(r"\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)\]")


def _pipe_pairs(rest: str) -> list[tuple[str, str]]:
    """'a: 1 | b c: 2 |' -> [('a', '1'), ('b c', '2')]; the colon-less older form 'lm loss 6.5E+00' too."""
    pairs = []
    for part in rest.split("|"):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.rpartition(":") if ":" in part else part.rpartition(" ")
        pairs.append((key.strip().lower(), value.strip()))
    return pairs


def parse_megatron(line: str, line_no: int = 0) -> Optional[IterRecord]:
    # every field Megatron prints ends with " |": a line that does not is cut (a log still being written, an
    # excerpt) or wrapped (a document); judged only once complete (scan_log joins a wrapped one)
    if "iteration" not in line.lower() or not line.rstrip().endswith("|"):
        return None
    m = _MEGATRON.search(line)
    if not m:
        return None
    rec = IterRecord(iteration=int(m.group(1)), line_no=line_no, fmt="megatron",
                     total=None if m.group(2).lower() == "infinity" else int(m.group(2)))
    ts = _TIMESTAMP.search(line[: m.start() + 1])
    rec.timestamp = ts.group(1) if ts else None
    losses: dict[str, float] = {}
    for key, value in _pipe_pairs(m.group(3)):
        if key.startswith("elapsed time per iteration"):
            number = parse_float(value)
            if number is not None:
                rec.iter_time_s = number / 1000.0 if "(ms)" in key else number
        elif key in ("learning rate", "lr"):
            rec.lr = parse_float(value)
        elif key == "grad norm":
            rec.grad_norm = parse_float(value)
        elif key == "global batch size":
            rec.batch_size = parse_int(value)
        elif key == "loss scale":
            rec.loss_scale = parse_float(value)
        elif key == "number of skipped iterations":
            rec.skipped_iterations = parse_int(value)
        elif key == "number of nan iterations":
            rec.nan_iterations = parse_int(value)
        elif key.endswith("loss") and key != "loss scale":
            number = parse_float(value)
            if number is not None:
                losses[key] = number
    if rec.skipped_iterations:
        # every iteration of the interval skipped: newer Megatron prints the 0/1 average as 0.000000E+00
        losses = {k: v for k, v in losses.items() if v != 0.0}
    _set_losses(rec, losses)
    return rec


# --------------------------------------------------------------------------- nanotron

_NANOTRON = re.compile(r"\biteration:\s*(\d{1,15})\s*/\s*(\d{1,15})\s*\|(.*)$")


def parse_nanotron(line: str, line_no: int = 0) -> Optional[IterRecord]:
    if "iteration:" not in line:
        return None
    m = _NANOTRON.search(line)
    if not m:
        return None
    rec = IterRecord(iteration=int(m.group(1)), line_no=line_no, fmt="nanotron", total=int(m.group(2)))
    losses: dict[str, float] = {}
    for part in m.group(3).split("|"):
        key, sep, value = part.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "elapsed_time_per_iteration_ms":
            ms = parse_human(value)
            rec.iter_time_s = ms / 1000.0 if ms is not None else None
        elif key == "lr":
            rec.lr = parse_human(value)
        elif key == "grad_norm":
            rec.grad_norm = parse_human(value)
        elif key == "global_batch_size":
            size = parse_human(value)
            rec.batch_size = int(size) if size is not None and math.isfinite(size) and 0 < size < 1e12 else None
        elif key == "tokens_per_sec":
            rec.tokens_per_s = parse_human(value)
        elif key.endswith("loss"):
            number = parse_human(value)
            if number is not None:
                losses[key] = number
    _set_losses(rec, losses)
    return rec


# --------------------------------------------------------------------------- torchtitan

_TITAN = re.compile(r"(?<![\w/])step:\s*(\d{1,15})\s+loss:\s*(\S+)")
_TITAN_KV = re.compile(r"(?<![\w/])(grad_norm|tps|lr|elapsed_time_per_step):\s*([^\s]+)")


def parse_torchtitan(line: str, line_no: int = 0) -> Optional[IterRecord]:
    if "step:" not in line or "loss:" not in line:
        return None
    m = _TITAN.search(line)
    if not m or "validat" in line[: m.start()].lower():  # torchtitan's `validate step:` lines are evaluation
        return None
    loss = parse_float(m.group(2))
    rec = IterRecord(iteration=int(m.group(1)), line_no=line_no, fmt="torchtitan")
    _set_losses(rec, {"loss": loss} if loss is not None else {})
    for key, value in _TITAN_KV.findall(line[m.end():]):
        if key == "grad_norm":
            rec.grad_norm = parse_float(value)
        elif key == "tps":
            rec.tokens_per_s = parse_float(value)
        elif key == "lr":
            rec.lr = parse_float(value)
        elif key == "elapsed_time_per_step":
            rec.iter_time_s = with_unit(value, default_ms=False)
    return rec


# --------------------------------------------------------------------------- Hugging Face Trainer

_DICT = re.compile(r"\{[^{}]{0,4000}\}")
_DICT_PAIR = re.compile(r"""['"]([^'"]{1,64})['"]\s*:\s*(?:[A-Za-z_][\w.]{0,40}\()?\s*"""
                        r"""([-+]?(?:\d[\d.]*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf(?:inity)?))""",
                        re.IGNORECASE)


def parse_hf(line: str, line_no: int = 0) -> Optional[IterRecord]:
    if "{" not in line or "loss" not in line:
        return None
    for m in _DICT.finditer(line):
        pairs = {k: v for k, v in ((k, parse_float(v)) for k, v in _DICT_PAIR.findall(m.group(0))) if v is not None}
        if "loss" not in pairs:  # eval ({'eval_loss': ...}) and the final {'train_runtime': ...} are not steps
            continue
        step = pairs.get("step", pairs.get("global_step"))
        rec = IterRecord(iteration=int(step) if step is not None and math.isfinite(step) and 0 <= step < 1e15
                         else None, line_no=line_no, fmt="hf")
        _set_losses(rec, {"loss": pairs["loss"]})
        rec.grad_norm = pairs.get("grad_norm")
        rec.lr = pairs.get("learning_rate", pairs.get("lr"))
        rec.epoch = pairs.get("epoch")
        return rec
    return None


# --------------------------------------------------------------------------- PyTorch Lightning (TQDM bar)

_LIGHTNING = re.compile(r"(?:^|\s)Epoch\s+(\d{1,9}):\s*"
                        r"(?:(\d{1,3})%\s*(?:\|[^|\[\]]{0,200}\|)?\s*(\d{1,15})/(\d{1,15}|\?)|(\d{1,15})it)"
                        r"\s*\[([^\[\]]{0,20000})\]")
_RATE = re.compile(r"^\s*([\d.]+)\s*(s/it|it/s)\s*$")
_LIGHTNING_LOSS = ("loss", "train_loss", "train_loss_step", "train/loss", "train/loss_step", "loss_step")
_LIGHTNING_GRAD = ("grad_norm", "train/grad_norm", "grad_2.0_norm_total", "grad_norm_total")
_LIGHTNING_LR = ("lr", "learning_rate", "train/lr")


def parse_lightning(line: str, line_no: int = 0) -> Optional[IterRecord]:
    if "Epoch" not in line:
        return None
    m = _LIGHTNING.search(line)
    if not m:
        return None
    n = int(m.group(3) or m.group(5))
    if n < 1:  # "Epoch 0:   0%| | 0/18 [00:00<?, ?it/s]": the bar before the first step
        return None
    total = parse_int(m.group(4)) if m.group(4) else None
    rec = IterRecord(iteration=n, line_no=line_no, fmt="lightning", total=total, epoch=float(m.group(1)))
    fields = [f.strip() for f in m.group(6).split(",")]
    if len(fields) > 1:
        rate = _RATE.match(fields[1])
        if rate:
            value = parse_float(rate.group(1))
            if value is not None and value > 0:
                rec.iter_time_s = value if rate.group(2) == "s/it" else 1.0 / value
    kv = {}
    for f in fields[2:]:
        key, sep, value = f.partition("=")
        if sep:
            kv[key.strip()] = value.strip()
    losses = {k: v for k, v in ((k, parse_float(kv[k])) for k in _LIGHTNING_LOSS if k in kv) if v is not None}
    _set_losses(rec, losses)
    rec.grad_norm = next((v for k in _LIGHTNING_GRAD if k in kv and (v := parse_float(kv[k])) is not None), None)
    rec.lr = next((v for k in _LIGHTNING_LR if k in kv and (v := parse_float(kv[k])) is not None), None)
    return rec


# --------------------------------------------------------------------------- key=value

_KV = re.compile(r"(?<![\w./-])([A-Za-z_][\w./-]{0,64})=([^\s,;|]{1,64})")
_KV_ITERATION = ("step", "iter", "iteration", "global_step", "train/global_step")
_KV_LOSS = ("loss", "lm_loss", "train_loss", "train/loss")
_KV_GRAD = ("grad_norm", "gnorm", "grad-norm", "train/grad_norm")
_KV_LR = ("lr", "learning_rate", "train/learning_rate")
_KV_TIME_S = ("step_time", "iter_time", "dt", "step_time_s", "iter_time_s", "time_per_step")
_KV_TIME_MS = ("step_time_ms", "iter_time_ms", "time_ms", "elapsed_ms")
_KV_BATCH = ("batch_size", "global_batch_size", "gbs")


def parse_kv(line: str, line_no: int = 0) -> Optional[IterRecord]:
    if "=" not in line:
        return None
    pairs = {k.lower(): v for k, v in _KV.findall(line)}
    it_key = next((k for k in _KV_ITERATION if k in pairs), None)
    if it_key is None:
        return None
    iteration = parse_int(pairs[it_key])
    if iteration is None:
        return None
    rec = IterRecord(iteration=iteration, line_no=line_no, fmt="kv")
    _set_losses(rec, {k: v for k, v in ((k, parse_float(pairs[k])) for k in _KV_LOSS if k in pairs)
                      if v is not None})
    rec.grad_norm = next((v for k in _KV_GRAD if k in pairs and (v := parse_float(pairs[k])) is not None), None)
    rec.lr = next((v for k in _KV_LR if k in pairs and (v := parse_float(pairs[k])) is not None), None)
    rec.batch_size = next((v for k in _KV_BATCH if k in pairs and (v := parse_int(pairs[k])) is not None), None)
    for keys, default_ms in ((_KV_TIME_MS, True), (_KV_TIME_S, False)):
        for key in keys:
            if key in pairs and (v := with_unit(pairs[key], default_ms)) is not None:
                rec.iter_time_s = v
                break
    # a lone `step=3` in some unrelated line is not a training record
    if rec.loss is None and rec.grad_norm is None and rec.lr is None and rec.iter_time_s is None:
        return None
    return rec


# Tried in this order; the cheap substring test at the top of each keeps a non-matching line at microseconds.
PARSERS: tuple[Callable[[str, int], Optional[IterRecord]], ...] = (
    parse_megatron, parse_nanotron, parse_torchtitan, parse_hf, parse_lightning, parse_kv)
