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
from dataclasses import dataclass
from typing import Optional

PREFIX = "gpuguard:"
MAX_LEN = 120

# Fixed vocabulary so tooling can act on reasons. A keyword may carry a numeric suffix (XID79).
KEYWORDS = frozenset(
    {
        "XID", "ECC", "ROWREMAP", "RETIRED", "RECOVERY", "THERMAL", "CLOCKS", "PCIE", "NVLINK", "FABRIC",
        "GPUCOUNT", "GPUMODEL", "GPUMEM", "NVML", "GPUPROC", "EFA", "IB", "NCCL", "DISK", "MEM",
        "CPU", "TIMEOUT", "FLAPPING", "INTERNAL", "DCGM",
    }
)

_KEYWORD_RE = re.compile(r"^([A-Z]+)(\d*)$")
# Characters that must never reach Slurm's reason field: quotes (break naive parsers and shell users),
# '=' (makes `scontrol show node -o` ambiguous), brackets other than our context, control chars.
_UNSAFE = re.compile(r"[\"'`=\[\]\\\x00-\x1f\x7f]")
_SPACES = re.compile(r"\s+")
_TAIL = r": (?P<detail>.*?)(?: \[(?P<context>[^\]]*)\])?$"
# The keyword is upper case and the check id lower case, so the two grammars can never be confused.
_REASON_RE = re.compile(r"^gpuguard: (?P<keyword>[A-Z]+\d*) (?P<check>[a-z0-9_.]+)" + _TAIL)
_LEGACY_REASON_RE = re.compile(r"^gpuguard: (?P<check>[a-z0-9_.]+) (?P<keyword>[A-Z]+\d*)" + _TAIL)


def sanitize(text: str) -> str:
    """Single line, printable ASCII, no quotes/'='/brackets, collapsed spaces."""
    text = text.encode("ascii", "replace").decode("ascii")
    text = _UNSAFE.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def valid_keyword(keyword: str) -> bool:
    m = _KEYWORD_RE.match(keyword)
    return bool(m) and m.group(1) in KEYWORDS


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
        body = body[: max(room - 3, 1)].rstrip() + "..."
    return head + body + tail


def is_ours(reason: Optional[str]) -> bool:
    """Written by gpuguard (either grammar): the only reasons gpuguard may replace or lift."""
    return bool(reason) and reason.lstrip().startswith(PREFIX)  # type: ignore[union-attr]


@dataclass(frozen=True)
class ParsedReason:
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
