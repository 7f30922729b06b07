"""Drain reasons: one grammar, safe to pass to scontrol, and recognisable as ours.

Grammar (DESIGN §3):  ``gpuguard: <KEYWORD> <check-id>: <detail> [<context> <action>]``
e.g. ``gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot]``

The keyword comes first because `sinfo -R` shows only the first ~20 characters of a reason: an admin at 3 am sees
``gpuguard: XID79 gpu.x`` rather than ``gpuguard: gpu.xid XI``. The context is the run kind, followed by the
action when it is more than a plain drain (reset / reboot / replace), so tooling can act on it without parsing
prose.

Reasons written by gpuguard before this grammar (``gpuguard: <check-id> <KEYWORD>: ...``) are still parsed and
still ours: a fleet being upgraded has nodes drained with them, and the health check and `gpuguard undrain` must
keep lifting those drains.
"""

from __future__ import annotations

import re
from typing import Optional

from gpuguard.util.record import Frozen, record
from gpuguard.util.lazyre import lazy

PREFIX = "gpuguard:"
MAX_LEN = 120

# Fixed vocabulary so tooling can act on reasons. A keyword may carry a numeric suffix (XID79). Each check declares
# its own keywords in its CheckSpec (gpuguard.checks); these are the ones no single check owns.
BASE_KEYWORDS = frozenset({"TIMEOUT", "FLAPPING", "INTERNAL"})
_keywords: Optional[frozenset[str]] = None


def keywords() -> frozenset[str]:
    """BASE_KEYWORDS plus every keyword a registered check declares (the check registry is imported on first use,
    so importing this module stays cheap)."""
    global _keywords
    if _keywords is None:
        from gpuguard.checks import check_keywords  # on first use: keep the registry off this import

        _keywords = BASE_KEYWORDS | check_keywords()
    return _keywords


def __getattr__(name: str) -> object:  # `reason.KEYWORDS`, derived on first use
    if name == "KEYWORDS":
        return keywords()
    raise AttributeError(name)


_KEYWORD_RE = lazy(r"^([A-Z]+)(\d*)$")
# Characters that must never reach Slurm's reason field: double quotes and backquotes (break naive parsers and
# shell users), '=' (makes `scontrol show node -o` ambiguous), brackets other than our context, backslashes,
# control chars. A single quote is kept inside a word ("the GPU's slowdown temperature"), nowhere else.
_UNSAFE = lazy(r"[\"`=\[\]\\\x00-\x1f\x7f]")
_STRAY_QUOTE = lazy(r"(?<![A-Za-z0-9])'|'(?![A-Za-z0-9])")
_SPACES = lazy(r"\s+")
_TAIL = r": (?P<detail>.*?)(?: \[(?P<context>[^\]]*)\])?$"
# The keyword is upper case and the check id lower case, so the two grammars can never be confused.
_REASON_RE = lazy(r"^gpuguard: (?P<keyword>[A-Z]+\d*) (?P<check>[a-z0-9_.]+)" + _TAIL)
_LEGACY_REASON_RE = lazy(r"^gpuguard: (?P<check>[a-z0-9_.]+) (?P<keyword>[A-Z]+\d*)" + _TAIL)


def sanitize(text: str) -> str:
    """Single line, printable ASCII, no double quotes/backquotes/'='/brackets/backslashes, an apostrophe only
    inside a word, collapsed spaces."""
    text = text.encode("ascii", "replace").decode("ascii")
    text = _UNSAFE.sub(" ", text)
    text = _SPACES.sub(" ", text)
    # after the spaces are collapsed: a quote next to a removed character must not end up inside a "word"
    return _SPACES.sub(" ", _STRAY_QUOTE.sub(" ", text)).strip()


def valid_keyword(keyword: str) -> bool:
    m = _KEYWORD_RE.match(keyword)
    return bool(m) and m.group(1) in keywords()


def safe_keyword(check_id: str, keyword: Optional[str]) -> str:
    """The keyword a reason for `check_id` may carry: `keyword` when the check declares it (or it is one of
    BASE_KEYWORDS), else the check's default keyword, else INTERNAL. Never raises: a check that emits a keyword it
    did not declare must not make the decision fail (the hook would fail open)."""
    try:
        from gpuguard.checks import find_check  # on first use: keep the registry off this import

        spec = find_check(check_id)
        if keyword and valid_keyword(keyword) and (spec is None or spec.declares(keyword)
                                                   or keyword.rstrip("0123456789") in BASE_KEYWORDS):
            return keyword
        if spec is not None and valid_keyword(spec.keyword):
            return spec.keyword
    except Exception:  # noqa: BLE001 - a broken registry still yields a reason
        pass
    return "INTERNAL"


def format_reason(check_id: str, keyword: str, detail: str, context: str, action: str = "drain") -> str:
    """Build a reason string of at most MAX_LEN characters; the detail is what gets shortened."""
    if not valid_keyword(keyword):
        raise ValueError(f"unknown drain keyword {keyword!r}")
    check_id = re.sub(r"[^a-z0-9_.]", "_", check_id.lower()) or "unknown"
    ctx_words = [sanitize(context).replace(" ", "_") or "manual"]
    if action not in ("drain", "none", ""):
        ctx_words.append(sanitize(action))
    tail = f" [{' '.join(ctx_words)}]"
    head = f"{PREFIX} {keyword} {check_id}: "
    room = MAX_LEN - len(head) - len(tail)
    body = sanitize(detail) or "failed"
    if len(body) > room:
        body = body[: max(room - 3, 1)].rstrip(" '") + "..."  # a cut word keeps no dangling apostrophe
    return head + body + tail


# What slurmctld and slurmd write themselves when something fails (Slurm 22.05-25.x): not an admin's words, so where
# gpuguard holds the evidence (a standing condition) its own reason replaces them (DESIGN §3). Matched as prefixes,
# case-insensitively: several carry details ("Low RealMemory (reported:1 < 100.00% of configured:2)").
SLURM_GENERIC_REASONS = ("prolog error", "epilog error", "kill task failed", "not responding",
                         "batch job complete failure", "node unexpectedly rebooted", "no network address found",
                         "low realmemory", "low tmpdisk", "low socket*core*thread count", "low cpus",
                         "gres/gpu count", "gres/gpu:", "health check failed", "job credential expired")


def is_slurm_generic(reason: Optional[str]) -> bool:
    """A reason Slurm wrote itself (not an admin's, not gpuguard's)."""
    text = (reason or "").strip().lower()
    return bool(text) and text.startswith(SLURM_GENERIC_REASONS)


def is_ours(reason: Optional[str]) -> bool:
    """Written by gpuguard (either grammar): the only reasons gpuguard may replace or lift."""
    return bool(reason) and reason.lstrip().startswith(PREFIX)  # type: ignore[union-attr]


@record
class ParsedReason(Frozen):
    check_id: str
    keyword: str
    detail: str
    context: str
    action: str  # "drain" when the context names no action
    legacy: bool = False  # written in the old `<check-id> <KEYWORD>:` order


def parse_reason(reason: str) -> Optional[ParsedReason]:
    """Inverse of format_reason, for both grammars (tolerates Slurm's appended ' [user@time]' being stripped
    already). None when the text is not a reason gpuguard wrote."""
    text = reason.strip()
    legacy = False
    m = _REASON_RE.match(text)
    if not m:
        m = _LEGACY_REASON_RE.match(text)
        legacy = True
    if not m:
        return None
    ctx = (m.group("context") or "").split()
    action = ctx[1] if len(ctx) > 1 else "drain"
    return ParsedReason(m.group("check"), m.group("keyword"), m.group("detail"), ctx[0] if ctx else "", action,
                        legacy)
