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

The data (NcclResult, NcclRow) lives in gpuguard.nccl.result, the text table's parser in gpuguard.nccl.table;
this module reads the `-J` JSON file and takes whichever `parse_nccl` is given.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

from gpuguard.config.yamlutil import NestingError, load_json
from gpuguard.nccl.result import NcclParseError, NcclResult, NcclRow
from gpuguard.nccl.table import nccl_version_string, parse_nccl_text


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
    try:
        doc = load_json(_json_start(text), "nccl-tests JSON")
    except NestingError:
        raise
    except ValueError as e:
        raise NcclParseError(f"not valid nccl-tests JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results", []), list):
        raise NcclParseError("not nccl-tests JSON: no results list")
    res = NcclResult(format="json", layout="json")
    _json_run(doc, res)
    bad = 0
    for item in doc.get("results") or []:
        row = _json_row(item)
        if row is None:
            bad += 1
            continue
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


def _json_run(doc: dict[str, Any], res: NcclResult) -> None:
    """The run's own facts: NCCL version, collective, parameters, devices."""
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


def _json_row(item: Any) -> Optional[NcclRow]:
    """One `results` record; None when it cannot be read."""
    if not isinstance(item, dict) or not isinstance(item.get("size"), int):
        return None
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
    return row


def parse_nccl(text: str, strict: bool = False) -> NcclResult:
    """Text or JSON, whichever `text` is. JSON nested too deeply to read gives a result with no rows and the
    error (what a probe or sweep wants: no exception upward); with `strict` (the CLI), NestingError is raised."""
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
