"""`dcgmi diag` without `-j`: the table admins paste (DCGM 3.x and 4.x). Pure: text in, the same
`DcgmObservation` the JSON parser gives, so the dcgm.diag check reaches the same verdict from either.

Shapes seen in real output (tests/fixtures/dcgm/README.md):

    Successfully ran diagnostic for group.
    +---------------------------+------------------------------------------------+
    | Diagnostic                | Result                                         |
    +===========================+================================================+
    |-----  Metadata  ----------+------------------------------------------------|
    | DCGM Version              | 3.3.8                                          |
    | GPU Device IDs Detected   | 2330,2330,2330,2330,2330,2330,2330,2330        |
    |-----  Deployment  --------+------------------------------------------------|
    | Persistence Mode          | Pass                                           |
    | Info                      | Persistence mode for GPU 0 is disabled. Enabl  |
    |                           | e persistence mode by running ...              |
    +-----  Hardware  ----------+------------------------------------------------+
    | GPU Memory                | Fail - All                                     |     (3.x: all GPUs of the run)
    | Warning                   | GPU 0 Error using CUDA API cuInit ...          |
    | GPU Memory                | Pass - GPU: 1                                  |     (3.x: per GPU)
    |                           | Fail - GPU: 0                                  |
    | memory                    | Pass                                           |     (4.x: the test, then per GPU)
    |                           | GPU0: Pass                                     |

Messages (Warning / Info / Error rows) are wrapped at the column width, mid-word: continuation cells are joined
as they are. A message that names a GPU ("GPU 3 ...") belongs to that GPU's result, as in the JSON.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from gpuguard.model import ProbeStatus
from gpuguard.probes.dcgm_result import (DcgmEntityResult, DcgmObservation, DcgmParseError, DcgmTest,
                                         normalise_status, worst_status)

_HEADER = re.compile(r"^\|\s*Diagnostic\s*\|\s*Result\s*\|\s*$", re.M)
_ROW = re.compile(r"^\|[^|]{10,60}\|[^|]{10,80}\|\s*$", re.M)  # a row of the table, for a pasted fragment
_BORDER = re.compile(r"^\+(-+)\+(-+)\+\s*$")
_CATEGORY = re.compile(r"^[|+]-+\s+(\S.*?)\s+-+[+|]")
_STATUS = r"(Pass|Fail|Skip|Skipped|Warn|Warning|Not Run)"
_TEST_VALUE = re.compile(rf"^{_STATUS}\b(?:\s*-\s*(All|GPUs?:?\s*([\d,\s]+)))?\s*$", re.I)
_GPU_LINE = re.compile(rf"^GPU\s*(\d+)\s*:\s*{_STATUS}\s*$", re.I)
_MESSAGE_ROWS = {"warning": "warnings", "error": "warnings", "info": "info"}
_NAMES_GPU = re.compile(r"\bGPU\s+(\d+)\b")
METADATA = {"dcgm version": "version", "driver version detected": "driver", "gpu device ids detected": "ids"}


def is_text_table(text: str) -> bool:
    """The table (or a fragment of it an admin pasted: two or more of its rows, no JSON)."""
    return bool(_HEADER.search(text)) or ("{" not in text and len(_ROW.findall(text)) >= 2)


@dataclass
class _Test:
    category: str
    name: str
    status: str
    scope: str = ""                     # "" (the run), "all", or "gpus"
    gpu_status: dict[int, str] = field(default_factory=dict)
    messages: list[tuple[str, str]] = field(default_factory=list)  # (warnings|info, text)


def _cells(line: str, split: int) -> Optional[tuple[str, str]]:
    """(name, value cell) of a `| name | value |` row, split at the header's column boundary."""
    if not line.startswith("|") or len(line.rstrip()) <= split or line.rstrip()[-1] != "|":
        return None
    row = line.rstrip()
    return row[1:split].strip(), row[split + 1:-1]


class _Reader:
    def __init__(self) -> None:
        self.meta: dict[str, str] = {}
        self.tests: list[_Test] = []
        self.category = ""
        self.message: Optional[list[str]] = None  # [kind, text so far]

    def row(self, name: str, cell: str) -> None:
        value = cell.strip()
        if not name:
            self._continuation(cell, value)
            return
        self.message = None
        key = name.lower()
        if key in METADATA:
            self.meta[METADATA[key]] = value
        elif key in _MESSAGE_ROWS and self.tests:
            self.message = [_MESSAGE_ROWS[key], _chunk(cell)]
            self.tests[-1].messages.append((self.message[0], ""))
            self._flush()
        else:
            self._test(name, value)

    def _test(self, name: str, value: str) -> None:
        m = _TEST_VALUE.match(value)
        status = normalise_status(m.group(1)) if m else normalise_status(value.split(" ")[0])
        test = _Test(self.category, name, status)
        if m and m.group(2):
            if m.group(2).lower() == "all":
                test.scope = "all"
            else:
                test.scope = "gpus"
                for g in re.findall(r"\d+", m.group(3) or ""):
                    test.gpu_status[int(g)] = status
        self.tests.append(test)

    def _continuation(self, cell: str, value: str) -> None:
        if not self.tests:
            return
        test = self.tests[-1]
        gpu = _GPU_LINE.match(value)
        per = _TEST_VALUE.match(value)
        if gpu:                                            # 4.x: "GPU0: Pass"
            self.message = None
            test.gpu_status[int(gpu.group(1))] = normalise_status(gpu.group(2))
        elif per and per.group(3) and self.message is None:  # 3.x: "Fail - GPU: 0"
            for g in re.findall(r"\d+", per.group(3)):
                test.gpu_status[int(g)] = normalise_status(per.group(1))
            test.scope = "gpus"
        elif self.message is not None:
            self.message[1] += _chunk(cell)
            self._flush()

    def _flush(self) -> None:
        assert self.message is not None
        kind, text = self.tests[-1].messages[-1]
        self.tests[-1].messages[-1] = (kind, self.message[1])


def _chunk(cell: str) -> str:
    """One wrapped piece of a message: the cell less DCGM's one leading and two trailing spaces. A full piece is
    exactly the message's next characters (spaces included); the last one's padding is stripped at the end."""
    return cell[1:-2] if len(cell) >= 3 else cell.strip()


def parse_dcgm_text(text: str) -> DcgmObservation:
    """Parse the `dcgmi diag` table. Raises DcgmParseError when there is none."""
    header = _HEADER.search(text) or _ROW.search(text)
    if not header:
        raise DcgmParseError("no `dcgmi diag` result table (| Diagnostic | Result |) in the output")
    start = header.end() if header.re is _HEADER else header.start()
    border = next((m for line in text.splitlines() if (m := _BORDER.match(line))), None)
    split = len(border.group(1)) + 1 if border else header.group(0).index("|", 1)
    reader = _Reader()
    for line in text[start:].splitlines():
        if not line.strip():
            if reader.tests:
                break  # the table ended
            continue
        cat = _CATEGORY.match(line)
        if cat:
            reader.category, reader.message = cat.group(1).strip(), None
            continue
        if _BORDER.match(line) or line.startswith("+="):
            reader.message = None
            continue
        cells = _cells(line, split)
        if cells is None:
            break  # text after the table
        reader.row(*cells)
    return _observation(reader)


def _observation(reader: _Reader) -> DcgmObservation:
    obs = DcgmObservation(status=ProbeStatus(), ran=True)
    obs.version = reader.meta.get("version") or None
    obs.driver_version = reader.meta.get("driver") or None
    for t in reader.tests:
        obs.tests.append(_dcgm_test(t))
    if not obs.tests:
        obs.error = "the diagnostic reported no tests"
    return obs


def _dcgm_test(t: _Test) -> DcgmTest:
    """Per-GPU results as the JSON has them: each GPU's status, with the messages that name it."""
    named: dict[int, list[str]] = {}
    unnamed: list[str] = []
    info: list[str] = []
    for kind, msg in t.messages:
        msg = msg.strip()
        if kind == "info":
            info.append(msg)
            continue
        gpus = {int(g) for g in _NAMES_GPU.findall(msg[:40])}
        for g in gpus:
            named.setdefault(g, []).append(msg)
        if not gpus:
            unnamed.append(msg)
    statuses = dict(t.gpu_status)
    if t.scope == "all" or (not statuses and t.status in ("fail", "warn") and named):
        for g in named:
            statuses.setdefault(g, t.status)
    # 3.x lists each group of GPUs with its own status ("Pass - GPUs: 1, 2", "Fail - GPU: 0"): the test's is the
    # worst of them, as the JSON's results give; 4.x's first line is the test's own (its test_summary)
    status = worst_status(list(statuses.values())) if t.scope == "gpus" and statuses else t.status
    test = DcgmTest(category=t.category, name=t.name, status=status)
    for g in sorted(statuses):
        test.results.append(DcgmEntityResult(status=statuses[g], gpus=[g], warnings=named.get(g, [])))
    if unnamed or not test.results:
        test.results.append(DcgmEntityResult(status=t.status, warnings=unnamed))
    test.summary_info = info
    return test
