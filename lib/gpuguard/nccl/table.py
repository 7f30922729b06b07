"""The nccl-tests text table, parsed (pure): every layout seen in the wild (see gpuguard.nccl.parse), launcher
prefixes included. Odd lines are skipped and counted, never raised."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from gpuguard.nccl.result import NcclResult, NcclRow


# Leading whitespace before a prefix is common: logs pasted into tickets and docs, or re-indented by a wrapper.
_SRUN = re.compile(r"^\s*(\d+): ?")
_MPIRUN = re.compile(r"^\s*\[(\d+),(\d+)\]<(stdout|stderr)>:")
_RAY = re.compile(r"^\s*\((?:[\w.-]+), rank=(\d+), pid=\d+\) ")


def _strip_prefixes(lines: list[str]) -> tuple[list[tuple[Optional[str], str]], Optional[str]]:
    """[(label, content)] and the launcher style. A style is applied only when most lines carry it, so a data
    row or hostname that happens to start with digits and a colon is never mistaken for a prefix."""
    meaningful = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("# source") and
                  not ln.lstrip().startswith("# note")]
    n = max(1, len(meaningful))

    def share(rx: re.Pattern[str]) -> float:
        return sum(1 for ln in meaningful if rx.match(_RAY.sub("", ln, count=1))) / n

    style: Optional[str] = None
    if share(_MPIRUN) >= 0.5:
        style = "mpirun"
    elif share(_SRUN) >= 0.5:
        style = "srun"
    out: list[tuple[Optional[str], str]] = []
    for ln in lines:
        label: Optional[str] = None
        m = _RAY.match(ln)
        if m:
            ln = ln[m.end():]
            label = m.group(1)
        if style == "mpirun":
            m2 = _MPIRUN.match(ln)
            if m2:
                ln = ln[m2.end():]
                label = m2.group(2)
        elif style == "srun":
            m3 = _SRUN.match(ln)
            if m3:
                ln = ln[m3.end():]
                label = m3.group(1)
        out.append((label, ln.rstrip()))
    return out, style


# --------------------------------------------------------------------------- table

_DTYPE = re.compile(r"^[a-z][a-z0-9_]*$")
_REDOPS = {"sum", "prod", "min", "max", "avg", "none", "mulsum", "premulsum"}
_FOOT_OOB = re.compile(r"Out of bounds values\s*:\s*(\d+)")
_FOOT_AVG = re.compile(r"Avg bus bandwidth\s*:\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))", re.IGNORECASE)
_VERSION = re.compile(r"nccl-tests version v?(\S+)(?:\s+nccl-headers=(\d+)\s+nccl-library=(\d+))?")
_NCCL_VERSION = re.compile(r"\bNCCL version (\d+\.\d+\.\d+)")
_COLLECTIVE = re.compile(r"Collective test starting:\s*(\S+)")
_PARAMS = re.compile(r"nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+)")
_ITERS = re.compile(r"warmup iters: (\d+) iters: (\d+)")
_RANK = re.compile(r"Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)")
_ERROR_LINE = re.compile(r"NCCL WARN|Test NCCL failure|Test CUDA failure|Test failure|^#? ?error:|\bFAILED\b")

# Header words -> our field names, for the value columns after `type`.
_TIME_WORDS = {"time", "cputime"}
_WRONG_WORDS = {"#wrong", "wrong"}


def parse_size(text: str) -> int:
    """nccl-tests size syntax: 8, 512K, 1M, 4G (powers of 1024), as `-b`/`-e` take them."""
    m = re.fullmatch(r"\s*(\d+)\s*([KkMmGgTt]?)[Bb]?\s*", str(text))
    if not m:
        raise ValueError(f"bad size {text!r} (want e.g. 8, 512K, 1M, 4G)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]


def nccl_version_string(code: int) -> str:
    """NCCL_VERSION_CODE -> "2.27.3" (22703). Codes before 2.9 were major*1000 + minor*100 + patch."""
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"


def _num(tok: str) -> Optional[float]:
    if tok.upper() == "N/A":
        return None
    v = float(tok)
    return None if math.isnan(v) else v


def _is_num(tok: str) -> bool:
    if tok.upper() == "N/A":
        return True
    try:
        float(tok)
    except ValueError:
        return False
    return True


def _header_columns(content: str) -> Optional[list[str]]:
    """Column words after `type` if `content` is the table header (with or without its `#`)."""
    words = content.lstrip("#").split()
    if len(words) < 6 or words[:3] != ["size", "count", "type"] or "busbw" not in words:
        return None
    return words[3:]


@dataclass
class _Layout:
    has_redop: bool
    has_root: bool
    values: list[str]  # value column words from the first time column on


def _layout_from_header(cols: list[str]) -> _Layout:
    has_redop = "redop" in cols
    has_root = "root" in cols
    start = next((i for i, w in enumerate(cols) if w in _TIME_WORDS), len(cols))
    values = cols[start:]
    # a timestamp column header ("timestamp") is printed after the in-place block; keep it, it is skipped
    return _Layout(has_redop, has_root, values)


_MODERN = _Layout(True, True, ["time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"])
_LEGACY = _Layout(True, False, ["time", "algbw", "busbw", "error", "time", "algbw", "busbw", "error"])


def _parse_row(tokens: list[str], layout: Optional[_Layout]) -> Optional[tuple[NcclRow, _Layout]]:
    """A data row, or None when the tokens are not one. The layout comes from the header, else it is inferred
    from the row (9 numbers after the redop = modern with root, 8 = legacy)."""
    if len(tokens) < 7 or not tokens[0].isdigit() or not tokens[1].isdigit() or not _DTYPE.match(tokens[2]):
        return None
    rest = tokens[3:]
    redop: Optional[str] = None
    if rest and not _is_num(rest[0]):
        redop = rest[0]
        rest = rest[1:]
        if redop not in _REDOPS and not re.match(r"^[a-z]+$", redop):
            return None
    if not rest or not all(_is_num(t) for t in rest[: min(len(rest), 8)]):
        return None
    if layout is None:
        nums = len([t for t in rest if _is_num(t)])
        layout = _MODERN if nums >= 9 and re.match(r"^-?\d+$", rest[0]) else _LEGACY
    root: Optional[int] = None
    value_cols = [w for w in layout.values if w != "timestamp"]
    if layout.has_root and rest and re.match(r"^-?\d+$", rest[0]) and len(rest) >= len(value_cols) // 2 + 1:
        root = int(rest[0])
        rest = rest[1:]
    values = rest
    row = NcclRow(size_bytes=int(tokens[0]), count=int(tokens[1]), dtype=tokens[2], redop=redop, root=root)
    half = len(value_cols) // 2
    if len(values) < len(value_cols):
        if len(values) >= half and len(values) < len(value_cols):
            # trace-replay rows print only the in-place block
            value_cols = ["skip"] * half + value_cols[half:]
            values = ["N/A"] * half + values[:half]
        else:
            return None
    seen: dict[str, int] = {}
    for word, tok in zip(value_cols, values):
        if word == "skip":
            continue
        if not _is_num(tok):
            return None
        nth = seen.get(word, 0)
        seen[word] = nth + 1
        side = "oop" if nth == 0 else "ip" if nth == 1 else None
        if side is None:
            continue
        v = _num(tok)
        if word in _TIME_WORDS:
            setattr(row, f"{side}_time_us", v)
        elif word == "algbw":
            setattr(row, f"{side}_algbw", v)
        elif word == "busbw":
            setattr(row, f"{side}_busbw", v)
        elif word in _WRONG_WORDS:
            setattr(row, f"{side}_wrong", v)
        elif word == "error":
            setattr(row, f"{side}_error", v)
    return row, layout


def parse_nccl_text(text: str) -> NcclResult:
    """Parse nccl-tests stdout (any layout above). Never raises on odd lines: they are skipped and, when they
    look like a broken data row, counted in `warnings`."""
    lines, style = _strip_prefixes(text.splitlines())
    res = NcclResult(format="text", prefix=style)
    layout: Optional[_Layout] = None
    table_label: Optional[str] = None
    headers_seen = 0
    ranks: dict[int, str] = {}
    malformed = 0
    for label, content in lines:
        stripped = content.strip()
        if not stripped:
            continue
        if table_label is not None and label is not None and label != table_label and res.rows:
            # another rank's output (NCCL INFO from every rank; whole tables when nccl-tests lacks MPI)
            if _header_columns(stripped) is not None:
                headers_seen += 1
            continue
        body = stripped.lstrip("#").strip()
        cols = _header_columns(stripped)
        if cols is not None:
            headers_seen += 1
            layout = _layout_from_header(cols)
            res.layout = "modern" if layout.has_root or any(w in _WRONG_WORDS for w in layout.values) else "legacy"
            continue
        if _read_tool_line(body, res, ranks) or _read_note(stripped, body, res):
            continue
        tokens = stripped.split()
        parsed = _parse_row(tokens, layout)
        if parsed is None:
            if tokens and tokens[0].isdigit() and len(tokens) >= 3 and tokens[1].isdigit():
                malformed += 1
            continue
        row, used = parsed
        if layout is None:
            layout = used
            res.layout = "modern" if used is _MODERN else "legacy"
        if table_label is None:
            table_label = label
        res.rows.append(row)
    _conclude(res, ranks, malformed, headers_seen, table_label)
    return res


def _read_tool_line(body: str, res: NcclResult, ranks: dict[int, str]) -> bool:
    """One of nccl-tests' own lines (footer, version, collective, parameters, a rank's device) into `res`; True
    when `body` was one."""
    m = _FOOT_OOB.search(body)
    if m and body.startswith("Out of bounds"):
        res.out_of_bounds = int(m.group(1))
        res.footer = True
        return True
    m = _FOOT_AVG.search(body)
    if m and body.startswith("Avg bus bandwidth"):
        v = float(m.group(1))
        res.avg_busbw_gbps = None if math.isnan(v) else v
        res.footer = True
        return True
    m = _VERSION.search(body)
    if m and body.startswith("nccl-tests version"):
        res.nccl_tests_version = m.group(1)
        if m.group(3):
            res.nccl_version = nccl_version_string(int(m.group(3)))
        return True
    m = _COLLECTIVE.search(body)
    if m:
        res.collective = m.group(1)
        return True
    m = _PARAMS.search(body)
    if m and body.startswith("nThread"):
        res.params.update(nthreads=int(m.group(1)), ngpus=int(m.group(2)), min_bytes=int(m.group(3)),
                          max_bytes=int(m.group(4)))
        it = _ITERS.search(body)
        if it:
            res.params.update(warmup_iters=int(it.group(1)), iters=int(it.group(2)))
        return True
    m = _RANK.search(body)
    if m and body.startswith("Rank"):
        ranks[int(m.group(1))] = m.group(2)
        return True
    return False


def _read_note(stripped: str, body: str, res: NcclResult) -> bool:
    """NCCL's version (noted, never consumed), error lines (kept, at most 10), comments and NCCL INFO lines:
    True when the line is not a candidate data row."""
    m = _NCCL_VERSION.search(body)
    if m and res.nccl_version is None:
        res.nccl_version = m.group(1)
    if _ERROR_LINE.search(stripped) and "NCCL INFO" not in stripped:
        if len(res.errors) < 10:
            res.errors.append(stripped[:300])
        return True
    return stripped.startswith("#") or "NCCL INFO" in stripped


def _conclude(res: NcclResult, ranks: dict[int, str], malformed: int, headers_seen: int,
              table_label: Optional[str]) -> None:
    if ranks:
        res.ranks = len(ranks)
        res.hosts = sorted(set(ranks.values()))
    if malformed:
        res.warnings.append(f"{malformed} table line(s) could not be read and were skipped")
    if headers_seen > 1:
        res.warnings.append(f"{headers_seen} result tables in the output: several processes printed their own "
                            "(nccl-tests built without MPI runs independent single-process tests); "
                            f"rank {table_label or 0}'s table was used")
    if res.rows and not res.footer:
        res.warnings.append("no footer (Out of bounds / Avg bus bandwidth): the run did not finish or the output "
                            "was cut")
