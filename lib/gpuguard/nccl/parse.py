"""Pure parsers for nccl-tests output: the text table in every layout seen in the wild, and the `-J` JSON file.

Layouts handled (tests/fixtures/nccl has a recorded example of each):

- modern table (`size count type redop root time algbw busbw #wrong ...`), with or without the
  `# nccl-tests version ...` header (v2.17.4+) and per-iteration / bitwise / timestamp columns;
- legacy table (no `root` column, a float `error` column instead of `#wrong`), including old alltoall rows
  whose redop column is blank;
- launcher prefixes: `N: ` (`srun -l`), `[1,0]<stdout>:` (`mpirun --tag-output`), `(head, rank=0, pid=N) `,
  also when indented (a log pasted into a ticket);
- NCCL INFO/WARN lines inside the table (from any rank), blank lines, `N/A` in `#wrong`, `redop none`,
  trailing whitespace, `#` lost from every tool line (markdown), a missing footer (crashed/truncated run).

"Avg bus bandwidth" in the footer is the mean over *all* sizes, small ones included: health decisions use the
bus bandwidth of large messages (`busbw_at`, `large_busbw`), never the average.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

# --------------------------------------------------------------------------- data


@dataclass
class NcclRow:
    """One message size. Bandwidths in GB/s as nccl-tests prints them (1e9 bytes/s); None = not reported."""

    size_bytes: int
    count: int
    dtype: str
    redop: Optional[str] = None
    root: Optional[int] = None
    oop_time_us: Optional[float] = None
    oop_algbw: Optional[float] = None
    oop_busbw: Optional[float] = None
    oop_wrong: Optional[float] = None  # modern `#wrong` (element count); None = N/A
    ip_time_us: Optional[float] = None
    ip_algbw: Optional[float] = None
    ip_busbw: Optional[float] = None
    ip_wrong: Optional[float] = None
    oop_error: Optional[float] = None  # legacy `error` column: max relative error, not a count
    ip_error: Optional[float] = None

    @property
    def busbw(self) -> Optional[float]:
        """Out-of-place bus bandwidth, the figure health decisions use (in-place when only that was run)."""
        return self.oop_busbw if self.oop_busbw is not None else self.ip_busbw


@dataclass
class NcclResult:
    format: str = "text"  # text | json
    rows: list[NcclRow] = field(default_factory=list)
    avg_busbw_gbps: Optional[float] = None  # the footer's "Avg bus bandwidth" (mean over all sizes)
    out_of_bounds: Optional[int] = None  # the footer's "Out of bounds values"
    layout: Optional[str] = None  # modern | legacy (text only)
    prefix: Optional[str] = None  # srun | mpirun | None
    collective: Optional[str] = None  # all_reduce_perf, AllReduce, ...
    nccl_tests_version: Optional[str] = None
    nccl_version: Optional[str] = None
    ranks: Optional[int] = None
    hosts: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)  # nThread, nGpus, minBytes, maxBytes, iters, ...
    footer: bool = False  # the run reached its summary lines
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # NCCL WARN / test failure lines, "# error:" lines

    # ------------------------------------------------------------------ figures
    @property
    def peak_busbw_gbps(self) -> Optional[float]:
        """Maximum out-of-place bus bandwidth over the data rows."""
        values = [r.oop_busbw for r in self.rows if r.oop_busbw is not None]
        return max(values) if values else None

    @property
    def largest(self) -> Optional[NcclRow]:
        return max(self.rows, key=lambda r: r.size_bytes) if self.rows else None

    def busbw_at(self, size_bytes: int) -> Optional[float]:
        for r in self.rows:
            if r.size_bytes == size_bytes:
                return r.busbw
        return None

    def large_busbw(self, min_bytes: int = 0) -> tuple[Optional[int], Optional[float]]:
        """(size, busbw) of the largest message measured, if it is at least `min_bytes`: the bandwidth plateau,
        which is what a slow link or GPU pulls down. (None, None) when no row is large enough."""
        row = self.largest
        if row is None or row.size_bytes < min_bytes or row.busbw is None:
            return None, None
        return row.size_bytes, row.busbw

    @property
    def wrong_total(self) -> Optional[float]:
        """Sum of the `#wrong` columns (None when the layout has none or every value was N/A)."""
        values = [v for r in self.rows for v in (r.oop_wrong, r.ip_wrong) if v is not None]
        return sum(values) if values else None

    @property
    def complete(self) -> bool:
        return bool(self.rows) and self.footer

    def summary(self) -> dict[str, Any]:
        """The report shape `gpuguard nccl parse --json` prints (and the torch probe reproduces)."""
        size, large = self.large_busbw()
        return {
            "rows": len(self.rows),
            "peak_busbw_gbps": _round(self.peak_busbw_gbps),
            "avg_busbw_gbps": _round(self.avg_busbw_gbps),
            "out_of_bounds": self.out_of_bounds,
            "largest_size_bytes": size,
            "busbw_at_largest_gbps": _round(large),
            "wrong_total": self.wrong_total,
            "format": self.format,
            "layout": self.layout,
            "prefix": self.prefix,
            "collective": self.collective,
            "nccl_tests_version": self.nccl_tests_version,
            "nccl_version": self.nccl_version,
            "ranks": self.ranks,
            "hosts": list(self.hosts),
            "footer": self.footer,
            "warnings": list(self.warnings),
            "errors": list(self.errors),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _round(v: Optional[float], nd: int = 3) -> Optional[float]:
    return None if v is None else round(v, nd)


class NcclParseError(ValueError):
    """The input is not nccl-tests output at all (nothing recognisable)."""


# --------------------------------------------------------------------------- launcher prefixes

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
        m = _FOOT_OOB.search(body)
        if m and body.startswith("Out of bounds"):
            res.out_of_bounds = int(m.group(1))
            res.footer = True
            continue
        m = _FOOT_AVG.search(body)
        if m and body.startswith("Avg bus bandwidth"):
            v = float(m.group(1))
            res.avg_busbw_gbps = None if math.isnan(v) else v
            res.footer = True
            continue
        m = _VERSION.search(body)
        if m and body.startswith("nccl-tests version"):
            res.nccl_tests_version = m.group(1)
            if m.group(3):
                res.nccl_version = nccl_version_string(int(m.group(3)))
            continue
        m = _COLLECTIVE.search(body)
        if m:
            res.collective = m.group(1)
            continue
        m = _PARAMS.search(body)
        if m and body.startswith("nThread"):
            res.params.update(nthreads=int(m.group(1)), ngpus=int(m.group(2)), min_bytes=int(m.group(3)),
                              max_bytes=int(m.group(4)))
            it = _ITERS.search(body)
            if it:
                res.params.update(warmup_iters=int(it.group(1)), iters=int(it.group(2)))
            continue
        m = _RANK.search(body)
        if m and body.startswith("Rank"):
            ranks[int(m.group(1))] = m.group(2)
            continue
        m = _NCCL_VERSION.search(body)
        if m and res.nccl_version is None:
            res.nccl_version = m.group(1)
        if _ERROR_LINE.search(stripped) and "NCCL INFO" not in stripped:
            if len(res.errors) < 10:
                res.errors.append(stripped[:300])
            continue
        if stripped.startswith("#") or "NCCL INFO" in stripped:
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
    return res


# --------------------------------------------------------------------------- JSON (-J)


def _jnum(v: Any) -> Optional[float]:
    """nccl-tests writes NaN as the string "nan" and booleans as "true"/"false" strings."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return None if math.isnan(float(v)) else float(v)
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return None
        return None if math.isnan(f) else f
    return None


def _json_start(text: str) -> str:
    """The JSON document, skipping any leading non-JSON lines (notes, a launcher's banner)."""
    for i, line in enumerate(text.splitlines(keepends=True)):
        if line.lstrip().startswith("{"):
            return "".join(text.splitlines(keepends=True)[i:])
    return text


def parse_nccl_json(text: str) -> NcclResult:
    """Parse the file nccl-tests writes with `-J PATH` (v2.17.3+). Raises NcclParseError on invalid JSON,
    gpuguard.config.yamlutil.NestingError (a ValueError) on JSON nested too deeply to read."""
    from gpuguard.config.yamlutil import NestingError, load_json

    try:
        doc = load_json(_json_start(text), "nccl-tests JSON")
    except NestingError:
        raise
    except ValueError as e:
        raise NcclParseError(f"not valid nccl-tests JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results", []), list):
        raise NcclParseError("not nccl-tests JSON: no results list")
    res = NcclResult(format="json", layout="json")
    if isinstance(doc.get("nccl_version"), int):
        res.nccl_version = nccl_version_string(doc["nccl_version"])
    args = doc.get("args")
    if isinstance(args, list) and args and isinstance(args[0], str):
        res.collective = args[0].rsplit("/", 1)[-1]
    cfg = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    for src, dst in (("nthreads", "nthreads"), ("ngpus", "ngpus"), ("minimum_bytes", "min_bytes"),
                     ("maximum_bytes", "max_bytes"), ("iterations", "iters"), ("warmup_iters", "warmup_iters")):
        if isinstance(cfg.get(src), int):
            res.params[dst] = cfg[src]
    devices = cfg.get("devices")
    if isinstance(devices, list):
        res.ranks = len(devices)
        res.hosts = sorted({d["hostname"] for d in devices if isinstance(d, dict) and isinstance(d.get("hostname"), str)})
    bad = 0
    for item in doc.get("results") or []:
        if not isinstance(item, dict) or not isinstance(item.get("size"), int):
            bad += 1
            continue
        root = str(item.get("root", "")).strip()
        row = NcclRow(size_bytes=item["size"], count=int(item.get("count") or 0), dtype=str(item.get("type", "")),
                      redop=item.get("redop") if isinstance(item.get("redop"), str) else None,
                      root=int(root) if re.match(r"^-?\d+$", root) else None)
        for key, side in (("out_of_place", "oop"), ("in_place", "ip")):
            blk = item.get(key)
            if not isinstance(blk, dict):
                continue
            setattr(row, f"{side}_time_us", _jnum(blk.get("time", blk.get("cpu_time"))))
            setattr(row, f"{side}_algbw", _jnum(blk.get("alg_bw")))
            setattr(row, f"{side}_busbw", _jnum(blk.get("bus_bw")))
            setattr(row, f"{side}_wrong", _jnum(blk.get("nwrong")))
        if res.collective is None and isinstance(item.get("experiment_name"), str):
            res.collective = item["experiment_name"]
        res.rows.append(row)
    oob = doc.get("out_of_bounds")
    if isinstance(oob, dict) and isinstance(oob.get("count"), int):
        res.out_of_bounds = oob["count"]
    avg = doc.get("average_bus_bandwidth")
    if isinstance(avg, dict):
        res.avg_busbw_gbps = _jnum(avg.get("bandwidth"))
        res.footer = True
    errs = doc.get("errors")
    if isinstance(errs, list):
        res.errors = [str(e)[:300] for e in errs if e][:10]
    if bad:
        res.warnings.append(f"{bad} result record(s) could not be read and were skipped")
    if res.rows and not res.footer:
        res.warnings.append("no average_bus_bandwidth: the run did not finish or the file was cut")
    return res


def parse_nccl(text: str, strict: bool = False) -> NcclResult:
    """Text or JSON, whichever `text` is. JSON nested too deeply to read gives a result with no rows and the
    error (what a probe or sweep wants: no exception upward); with `strict` (the CLI), NestingError is raised."""
    from gpuguard.config.yamlutil import NestingError

    body = _json_start(text).lstrip()
    if body.startswith("{"):
        try:
            return parse_nccl_json(text)
        except NestingError as e:
            if strict:
                raise
            return NcclResult(format="json", errors=[str(e)])
        except NcclParseError:
            pass  # a text log whose first brace line is not the document; fall through
    return parse_nccl_text(text)


def merge_rows(results: Iterable[NcclResult]) -> list[NcclRow]:
    return [r for res in results for r in res.rows]
