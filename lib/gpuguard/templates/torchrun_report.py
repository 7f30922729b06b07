"""What torchrun says about the workers that failed (pure): the root causes of its failure report in the job
output, and its error files (TORCHELASTIC_ERROR_FILE)."""

from __future__ import annotations

import re
from typing import Optional

from gpuguard.templates.attempts import WorkerExit

# torchrun's ChildFailedError report (torch/distributed/elastic/multiprocessing/errors/__init__.py, the
# _FAILURE_FORMAT_TEMPLATE): "Root Cause (first observed failure):" then "[0]:", "  host : ...",
# "  rank : 1 (local_rank: 1)", "  exitcode : 3 (pid: 1234)". Lines may carry srun's "N: " label.
_LABEL = r"^(?:\d+: )?"
_ROOT_CAUSE = re.compile(_LABEL + r"Root Cause \(first observed failure\):\s*$")
_REPORT_FIELD = re.compile(_LABEL + r"\s+(time|host|rank|exitcode|error_file|traceback)\s*: ?(.*?)\s*$")


def parse_torchrun_failures(text: str) -> list[WorkerExit]:
    """The root causes in torchrun's failure reports in `text` (one per torchrun that failed), in order."""
    out: list[WorkerExit] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not _ROOT_CAUSE.match(lines[i]):
            i += 1
            continue
        fields: dict[str, str] = {}
        j = i + 1
        while j < len(lines) and j <= i + 12:
            m = _REPORT_FIELD.match(lines[j])
            if m:
                fields.setdefault(m.group(1), m.group(2))
            elif fields and not re.match(_LABEL + r"\[\d+\]:\s*$", lines[j]):
                break
            j += 1
        code = re.match(r"(-?\d+)", fields.get("exitcode", ""))
        if code:
            rank = re.match(r"(\d+)", fields.get("rank", ""))
            out.append(WorkerExit(exit_code=int(code.group(1)), rank=int(rank.group(1)) if rank else None,
                                  host=fields.get("host") or None, source="torchrun_report"))
        i = j
    return out


def parse_error_file(data: object, host: Optional[str] = None) -> Optional[WorkerExit]:
    """torchrun's error file (TORCHELASTIC_ERROR_FILE of the torchrun process): the failed worker's own report,
    {"message": {"message": "RuntimeError: ...", "extraInfo": {...}, "errorCode": 3}}, written when the worker
    used torch.distributed.elastic's @record (errorCode: its exit code; absent for an exception, i.e. 1)."""
    if not isinstance(data, dict):
        return None
    msg = data.get("message")
    if isinstance(msg, dict):
        code = msg.get("errorCode")
        text = msg.get("message")
    else:
        code, text = data.get("errorCode"), msg
    if isinstance(code, bool) or not isinstance(code, int):
        code = 1 if text else None
    if code is None:
        return None
    return WorkerExit(exit_code=code, host=host, source="error_file",
                      message=str(text).strip().splitlines()[-1][:300] if text else None)
