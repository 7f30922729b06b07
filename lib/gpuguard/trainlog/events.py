"""Lines that are not progress lines but must not be missed: a framework's own NaN/Inf check firing, fp16 loss
scaling giving up, and the markers of a resumed attempt. The strings are the frameworks' own (sources below);
each pattern is anchored on a fixed phrase, so a line costs a few substring tests unless it contains one.

Megatron-LM (NVIDIA/Megatron-LM):
* `megatron/core/rerun_state_machine.py::validate_result`, reruns disabled (raised as RuntimeError):
  ``f"Rank {rank}, node {node}, device {device}, iteration {self.current_iteration}: "
  f"Unexpected result {result} (message='{message}')"``;
  reruns enabled (logged): ``f"Unexpected result {result} on rank {rank} at iteration #{it} invocation #{n}
  (message='{message}')"``, then the diagnosis ``f"Rank {rank}, node {node}, device {device}, iteration #{it}:
  {message}!"`` (it names the GPU it runs on): "First rerun: unexpected result is reproducible within the
  tolerance ..." (same GPU), then "Possible transient error" (the same GPU gave another result), "Possible
  persistent error" (another GPU gave another result: the first GPU is suspect) or "Correct result (but possible
  Application error) (...)" (another GPU agreed).
* The messages passed to it: `pretrain_gpt.py::loss_func` "found NaN in local forward loss calculation" /
  "found Inf in local forward loss calculation" (fatal), "Spiky loss" (not fatal);
  `megatron/core/distributed/param_and_grad_buffer.py::check_grads` "found NaN in local grad norm for bucket #{i}
  in backward pass before data-parallel communication collective", "found Inf in local grad norm ...", and
  "found unexpected large grads in bucket #{i} ..." (not fatal).
* Before the rerun state machine (Megatron-LM <= 0.8) the same checks were assertions:
  ``f'Rank {global_rank}: found NaN in local grad norm in backward pass before data-parallel communication
  collective. Device: {torch.cuda.current_device()}, node: {os.uname()[1]}'`` and ``... found NaN in local
  forward loss calculation. ...``.
* `megatron/training/checkpointing.py::load_checkpoint`: ``f'  successfully loaded checkpoint from {load_dir}
  [ t {tp}/{tps}, p {pp}/{pps} ] at iteration {iteration}'`` (a resumed attempt).

DeepSpeed `deepspeed/runtime/fp16/loss_scaler.py`: "Current loss scale already at minimum - cannot decrease scale
anymore. Exiting run." (fp16 overflows that loss scaling can no longer absorb) and
``f"[deepspeed] OVERFLOW! Rank {rank} Skipping step. Attempted loss scale: {cur}, reducing to {next}"``
(normal while the scaler calibrates, and now and then later; many in a row once training is under way are
flagged by the analysis), with ``f"... Attempted loss scale: {cur}, but hysteresis is {h}. Reducing hysteresis to
{h - 1}"`` when only the hysteresis goes down.

Resume markers of the other frameworks: torchtitan ``f"Training starts at step {self.step + 1}"``, Hugging Face
Trainer ``f"  Continuing training from global step {self.state.global_step}"``, Lightning
``f"Restoring states from the checkpoint path at {checkpoint_path}"``.

There is no "Bad grad_norm detected" message in Megatron-LM (searched: not in its source); a non-finite grad norm
shows up as ``grad norm: nan`` on the iteration line or as the "found NaN/Inf in local grad norm" checks above.
"""

from __future__ import annotations

import re
from typing import Optional

from gpuguard.trainlog.records import LogEvent, parse_int

_RERUN_RAISED = re.compile(r"Rank (\d+), node (\S+), device (\d+), iteration #?(-?\d{1,15}): "
                           r"Unexpected result (\S{1,64}) \(message='([^']{0,500})'\)")
_RERUN_LOGGED = re.compile(r"Unexpected result (\S{1,64}) on rank (\d+) at iteration #(-?\d{1,15}) "
                           r"invocation #\d+ \(message='([^']{0,500})'\)")
_RERUN_FAILURE = re.compile(r"Rank (\d+), node (\S+), device (\d+), iteration #(-?\d{1,15}): (.{1,600}?)!*\s*$")
_ASSERTION = re.compile(r"Rank (\d+): (found (?:NaN|Inf) in local (?:grad norm in backward pass before "
                        r"data-parallel communication collective|forward loss calculation))"
                        r"(?:\. Device: (\d+)(?:, node: (\S+))?)?")
_MEGATRON_RESUME = re.compile(r"successfully loaded checkpoint from (\S{1,4096}).{0,80}? at iteration (\d{1,15})")
_TITAN_RESUME = re.compile(r"Training starts at step (\d{1,15})")
_HF_RESUME = re.compile(r"Continuing training from global step (\d{1,15})")
_LIGHTNING_RESUME = "Restoring states from the checkpoint path at"
_DS_MIN_SCALE = "cannot decrease scale anymore"
_DS_OVERFLOW = "OVERFLOW! Rank"
_DS_SCALES = re.compile(r"Attempted loss scale: (\d{1,20}(?:\.\d*)?)(?:, reducing to (\d{1,20}(?:\.\d*)?))?")


def _iteration(text: str) -> Optional[int]:
    """Megatron reports iteration -1 before the first step completes."""
    return None if text.startswith("-") else parse_int(text)


def _diagnosis(rank: str, node: str, device: str, it: str, verdict: str, line_no: int) -> Optional[LogEvent]:
    """Megatron's rerun state machine reruns a failed iteration on the same GPU, then from a checkpoint on
    another GPU, and logs what it concluded (`log_failure`, which names the GPU it is running on)."""
    where = f"{node} GPU {device}"
    iteration = _iteration(it)
    if verdict.startswith("First rerun: unexpected result is reproducible"):
        # the same GPU reproduced it; the next verdict comes from another GPU: remember who computed it first
        return LogEvent("rerun_first", "info", line_no, f"iteration {it} reproduced on {where}", iteration,
                        node=node, rank=int(rank), detail=where)
    if verdict.startswith("Possible transient error"):
        message = (f"Megatron reran iteration {it} on the same GPU and got a different result: possible "
                   f"transient fault on {where} (rank {rank})")
        return LogEvent("rerun_diagnosis", "critical", line_no, message, iteration, node, int(rank),
                        "possible transient error")
    if verdict.startswith("Possible persistent error"):
        message = (f"Megatron reran iteration {it} on another GPU ({where}) and got a different result: possible "
                   "persistent fault on the GPU that first computed it")
        return LogEvent("rerun_diagnosis", "critical", line_no, message, iteration, node, int(rank),
                        "possible persistent error")
    if verdict.startswith("Correct result"):
        message = (f"Megatron reran iteration {it} on another GPU ({where}) and got the same result: not a "
                   "hardware fault, the application produced it")
        return LogEvent("rerun_diagnosis", "warning", line_no, message, iteration, node, int(rank),
                        "reproduced on another GPU")
    return None


def _check_severity(message: str) -> str:
    """Megatron's fatal checks are the NaN/Inf ones; "Spiky loss" and "unexpected large grads" are not fatal."""
    return "critical" if re.search(r"\b(?:NaN|Inf)\b", message) else "warning"


def parse_event(line: str, line_no: int = 0) -> Optional[LogEvent]:
    """One line -> a LogEvent, or None. Never raises."""
    if "Unexpected result" in line:
        m = _RERUN_RAISED.search(line)
        if m:
            rank, node, device, it, result, message = m.groups()
            return LogEvent("nan_check", _check_severity(message), line_no,
                            f"Megatron check failed on rank {rank} ({node}, GPU {device}): {message} "
                            f"(result {result})", iteration=_iteration(it), node=node, rank=int(rank),
                            detail=message)
        m = _RERUN_LOGGED.search(line)
        if m:
            result, rank, it, message = m.groups()
            return LogEvent("nan_check", _check_severity(message), line_no,
                            f"Megatron check failed on rank {rank}: {message} (result {result})",
                            iteration=_iteration(it), rank=int(rank), detail=message)
    if "Rank " in line and "found " in line:
        m = _ASSERTION.search(line)
        if m:
            rank, message, device, node = m.groups()
            where = ", ".join(x for x in (node, f"GPU {device}" if device else None) if x)
            return LogEvent("nan_check", "critical", line_no,
                            f"Megatron check failed on rank {rank}{f' ({where})' if where else ''}: {message}",
                            node=node, rank=int(rank), detail=message)
    if "iteration #" in line and ("Possible" in line or "Correct result" in line or "First rerun" in line):
        m = _RERUN_FAILURE.search(line)
        if m:
            return _diagnosis(*m.groups(), line_no=line_no)
    if _DS_MIN_SCALE in line:
        return LogEvent("loss_scale_min", "critical", line_no,
                        "DeepSpeed: fp16 loss scale already at its minimum and still overflowing (run exits)",
                        detail="loss scale at minimum")
    if _DS_OVERFLOW in line and "Skipping step" in line:
        m = _DS_SCALES.search(line)
        return LogEvent("overflow", "info", line_no, "DeepSpeed fp16 overflow: step skipped, loss scale reduced",
                        scale_from=float(m.group(1)) if m else None,
                        scale_to=float(m.group(2)) if m and m.group(2) else None)
    if "checkpoint" in line:
        m = _MEGATRON_RESUME.search(line)
        if m:
            return LogEvent("resume", "info", line_no, f"resumed from {m.group(1)} at iteration {m.group(2)}",
                            iteration=parse_int(m.group(2)))
        if _LIGHTNING_RESUME in line:
            return LogEvent("resume", "info", line_no, "Lightning restored a checkpoint")
    if "Training starts at step" in line:
        m = _TITAN_RESUME.search(line)
        if m:
            step = parse_int(m.group(1))
            return LogEvent("resume", "info", line_no, f"training starts at step {m.group(1)}",
                            iteration=step - 1 if step else None)
    if "Continuing training from global step" in line:
        m = _HF_RESUME.search(line)
        if m:
            return LogEvent("resume", "info", line_no, f"continuing from global step {m.group(1)}",
                            iteration=parse_int(m.group(1)))
    return None
