"""DCGM diagnostics: `dcgmi diag -r LEVEL -j`, and a pure parser for its JSON (per test pass/fail/warn/skip with
DCGM's own messages and error severities).

Shapes seen in real output (tests/fixtures/dcgm):

- DCGM 2.x/3.x: ``{"DCGM GPU Diagnostic": {"test_categories": [{"category", "tests": [{"name", "results":
  [{"gpu_ids": "0,1" | 0, "status": "PASS", "warnings": ["text"], "info": [...]}]}]}], "version": "3.1.0"}}``,
  with `null` entries inside `tests`, and sometimes a warning line printed *before* the JSON;
- DCGM 4.x: the same tree under ``"DCGM Diagnostic"``, entity results (`entity_group`/`entity_id`), warnings as
  objects with `error_id`/`error_severity`/`error_category`, a `test_summary` per test, `metadata.version`.

`error_severity` is DCGM's own verdict (dcgm_errors.h): 1 MONITOR, 2 ISOLATE, 3 UNKNOWN, 4 TRIAGE, 5 CONFIG
(fix a setting, e.g. persistence mode), 6 RESET (drain and reset the GPU). The check maps it to our actions.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from gpuguard.model import ProbeStatus
from gpuguard.probes.dcgm_result import (SEVERITY_NAMES, DcgmEntityResult, DcgmObservation, DcgmParseError, DcgmTest,
                                         normalise_status, worst_status)
from gpuguard.probes.dcgm_text import is_text_table, parse_dcgm_text
from gpuguard.util.toolrun import run_tool

# What the dcgm.diag check and the CLI read from here; the types live in dcgm_result, shared with the table parser.
__all__ = ["SEVERITY_NAMES", "DcgmEntityResult", "DcgmObservation", "DcgmParseError", "DcgmTest",
           "normalise_status", "parse_dcgm_diag", "run_dcgm_diag"]


def _gpu_ids(result: dict[str, Any]) -> list[int]:
    if "entity_id" in result:
        group = str(result.get("entity_group", "GPU")).upper()
        if group == "GPU" and isinstance(result["entity_id"], int):
            return [result["entity_id"]]
        return []
    raw = result.get("gpu_ids", result.get("gpu_id"))
    if isinstance(raw, int) and not isinstance(raw, bool):
        return [raw]
    if isinstance(raw, str):
        return [int(p) for p in raw.replace(" ", "").split(",") if p.isdigit()]
    return []


def _messages(items: Any) -> tuple[list[str], list[int], list[int]]:
    """(texts, severities, error ids) from a `warnings` list of strings (3.x) or objects (4.x)."""
    texts: list[str] = []
    sev: list[int] = []
    ids: list[int] = []
    if not isinstance(items, list):
        return texts, sev, ids
    for w in items:
        if isinstance(w, str):
            texts.append(w.strip())
        elif isinstance(w, dict):
            msg = w.get("warning", w.get("message", ""))
            if isinstance(msg, str) and msg.strip():
                texts.append(msg.strip())
            if isinstance(w.get("error_severity"), int):
                sev.append(w["error_severity"])
            if isinstance(w.get("error_id"), int):
                ids.append(w["error_id"])
    return texts, sev, ids


def _strings(items: Any) -> list[str]:
    return [s.strip() for s in items if isinstance(s, str) and s.strip()] if isinstance(items, list) else []


def _document(text: str) -> dict[str, Any]:
    """The JSON object in dcgmi's stdout: it may be preceded (and followed) by other lines."""
    start = text.find("{")
    if start < 0:
        raise DcgmParseError("no JSON object in the output" + (f": {text.strip()[:200]!r}" if text.strip() else ""))
    try:
        doc, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError as e:
        raise DcgmParseError(f"invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise DcgmParseError("the JSON is not an object")
    return doc


def parse_dcgm_diag(text: str) -> DcgmObservation:
    """Parse `dcgmi diag -j` output (any version above), or the table `dcgmi diag` prints without -j
    (gpuguard.probes.dcgm_text). Raises DcgmParseError when there is neither."""
    if is_text_table(text):
        return parse_dcgm_text(text)
    doc = _document(text)
    root = doc.get("DCGM GPU Diagnostic", doc.get("DCGM Diagnostic"))
    if not isinstance(root, dict):
        raise DcgmParseError("no 'DCGM GPU Diagnostic' / 'DCGM Diagnostic' object")
    obs = DcgmObservation(status=ProbeStatus(), ran=True)
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    obs.version = str(meta.get("version") or root.get("version") or "") or None
    drv = meta.get("Driver Version Detected") or root.get("Driver Version Detected") or root.get("driver_version")
    obs.driver_version = str(drv) if drv else None
    runtime_error = root.get("runtime_error") or doc.get("runtime_error")
    if runtime_error:
        obs.error = str(runtime_error).strip()[:300]
    for cat in root.get("test_categories") or []:
        if not isinstance(cat, dict):
            continue
        category = str(cat.get("category", ""))
        for t in cat.get("tests") or []:
            if isinstance(t, dict) and t.get("name"):  # DCGM 3.x prints `null` between tests
                obs.tests.append(_test(category, t))
    if not obs.tests and obs.error is None:
        obs.error = "the diagnostic reported no tests"
    return obs


def _test(category: str, t: dict[str, Any]) -> DcgmTest:
    """One test of the JSON: its per-entity results, and its summary (4.x) when there is one."""
    test = DcgmTest(category=category, name=str(t["name"]), status="skip")
    for r in t.get("results") or []:
        if not isinstance(r, dict):
            continue
        texts, sev, ids = _messages(r.get("warnings"))
        test.results.append(DcgmEntityResult(status=normalise_status(r.get("status")), gpus=_gpu_ids(r),
                                             warnings=texts, info=_strings(r.get("info")),
                                             severities=sev, error_ids=ids))
    summary = t.get("test_summary") if isinstance(t.get("test_summary"), dict) else None
    if summary is not None:
        texts, sev, ids = _messages(summary.get("warnings"))
        test.summary_warnings = texts
        test.summary_info = _strings(summary.get("info"))
        if sev and not any(r.severities for r in test.results):
            test.results.append(DcgmEntityResult(status=normalise_status(summary.get("status")),
                                                 warnings=[], severities=sev, error_ids=ids))
    if summary is not None and summary.get("status"):
        test.status = normalise_status(summary.get("status"))
    else:
        test.status = worst_status([r.status for r in test.results])
    return test


# --------------------------------------------------------------------------- runner


def run_dcgm_diag(dcgmi: str = "dcgmi", level: int = 1, timeout_s: float = 120.0,
                  gpus: Optional[list[int]] = None) -> DcgmObservation:
    """Run `dcgmi diag -r LEVEL -j [-i GPUS]` (argv list, own session, hard timeout). Never raises.

    dcgmi exits non-zero when a test fails, so its output is parsed whatever the exit code; a missing dcgmi is
    `tool_missing` (incomplete), a host engine that is not running is an `error` (incomplete).
    """
    t0 = time.monotonic()
    argv = [dcgmi, "diag", "-r", str(int(level)), "-j"]
    if gpus:
        argv += ["-i", ",".join(str(int(g)) for g in gpus)]
    obs = DcgmObservation(level=int(level))
    run = run_tool(argv, timeout_s)
    if run.missing:
        obs.tool_missing = True
        obs.status = ProbeStatus(complete=False, error=f"{os.path.basename(dcgmi)} not found (DCGM not installed)")
        return obs
    if run.timed_out:
        obs.status = ProbeStatus(complete=False, error=f"dcgmi diag -r {level} timed out after {timeout_s:g}s",
                                 timed_out=True, duration_s=time.monotonic() - t0)
        return obs
    if run.rc is None:
        obs.status = ProbeStatus(complete=False, error=run.error)
        return obs
    out, err = run.text(), run.err_text()
    try:
        parsed = parse_dcgm_diag(out)
    except DcgmParseError as e:
        last = (err.strip() or out.strip()).splitlines()
        obs.error = (last[-1] if last else str(e))[:300]
        obs.exit_code = run.rc
        obs.status = ProbeStatus(complete=False, error=f"dcgmi diag: {obs.error}", duration_s=time.monotonic() - t0)
        return obs
    parsed.level = int(level)
    parsed.exit_code = run.rc
    parsed.status = ProbeStatus(complete=parsed.error is None, error=parsed.error,
                                duration_s=time.monotonic() - t0)
    return parsed
