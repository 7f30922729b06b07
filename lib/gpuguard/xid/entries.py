"""An Xid catalog's contents (pure): XidInfo for one code, XidCatalog for all of them with its queries (lookup,
the per-message rules of Xid 154 and the NVLink5 Xids 144-150, `explain`). Loaded by gpuguard.xid.catalog."""

from __future__ import annotations

import re
from typing import Mapping, Optional

from gpuguard.util.record import Frozen, field, record, replace

NVIDIA_CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

SEVERITIES = ("fatal", "app", "warn", "info")
ACTIONS = ("none", "drain", "reset", "reboot", "replace")  # least to most invasive, as gpuguard.model.Action
CAUSES = ("hw", "driver", "user_app", "system_memory", "bus", "thermal", "fb_corruption")

# What a site may change per code (or for `unknown`). Codes, NVIDIA's bucket and causes are facts, not policy.
OVERRIDE_KEYS = ("severity", "action", "note", "name", "description", "nvidia_action_text")

_SEVERITY_TEXT = {
    "fatal": "fatal: the node takes no new jobs",
    "app": "app: the job's application was hit; the node stays in service",
    "warn": "warn: recorded and alerted; the node stays in service",
    "info": "info: informational only",
}
_ACTION_TEXT = {
    "none": "nothing on the node",
    "drain": "drain the node for an admin to investigate",
    "reset": "drain the node; a GPU reset is expected to fix it",
    "reboot": "drain the node; a reboot is expected to fix it",
    "replace": "drain the node for hardware inspection (possible RMA)",
}
# "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
_XID154_TARGET = re.compile(r"\bto\s+(0x[0-9a-fA-F]+|\d+)\s*(?:\(([^)]*)\))?")
# NVLink5 Xids 144-150 (Blackwell) name the unit/subcode and whether the driver judged the event fatal, e.g.
#   "145, RLW_REMAP Nonfatal XC0 i0 Link 02"                       (NVIDIA/TensorRT-LLM#4816, B200 HGX)
#   "149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 ...)"   (leptonai/gpud#1174)
# NVIDIA's "XID 144-150 Decode" sheet (Xid-Catalog.xlsx) maps every Nonfatal status to IGNORE and Fatal ones to
# RESET_GPU (or XID_154_EVAL, which the recovery-action check covers).
NVLINK5_CODES = frozenset(range(144, 151))
_NVLINK5_DETAIL = re.compile(r"^\s*(?P<unit>[A-Za-z][A-Za-z0-9_]*)\s+(?P<sev>Fatal|Nonfatal|Non-fatal)\b"
                             r"(?:.*?\bLink\s+(?P<link>-?\d+))?", re.IGNORECASE)


def decode_nvlink5(detail: str) -> Optional[tuple[str, bool, Optional[int]]]:
    """(unit/subcode, fatal?, link) from an Xid 144-150 message, or None when the message has no severity token."""
    m = _NVLINK5_DETAIL.match(detail or "")
    if not m:
        return None
    link = int(m.group("link")) if m.group("link") is not None else None
    return m.group("unit"), m.group("sev").lower() == "fatal", link


class XidCatalogError(ValueError):
    """The catalog file or a site override is invalid. The message names the code and the key."""


@record
class XidInfo(Frozen):
    """One Xid code: NVIDIA's description and recommended action, and gpuguard's severity and node action."""

    code: int
    name: str
    description: str
    nvidia_action: str  # NVIDIA's immediate resolution bucket, verbatim ("" where the catalog lists none)
    nvidia_action_text: str  # short paraphrase of what NVIDIA recommends for this code
    severity: str  # fatal | app | warn | info
    action: str  # none | drain | reset | reboot | replace
    causes: tuple[str, ...] = ()
    note: str = ""  # why gpuguard departs from, or had to interpret, NVIDIA's bucket
    mnemonic: str = ""
    nvidia_investigatory: str = ""  # NVIDIA's investigatory resolution bucket, verbatim
    source: str = "catalog"  # catalog | override (site config changed it) | unknown (not in the catalog)

    @property
    def is_fatal(self) -> bool:
        return self.severity == "fatal"


@record
class XidCatalog(Frozen):
    """Immutable code -> XidInfo map with the `unknown` fallback. Build it with `load_catalog`."""

    entries: Mapping[int, XidInfo]
    unknown: XidInfo  # template for codes not in `entries` (its code is 0)
    buckets: Mapping[str, str] = field(default_factory=dict)  # bucket token -> NVIDIA's meaning (paraphrased)
    xid154_by_label: Mapping[str, str] = field(default_factory=dict)  # "Node Reboot Required" -> "reboot"
    xid154_by_value: Mapping[int, str] = field(default_factory=dict)  # nvmlGpuRecoveryAction value -> action
    path: str = ""

    def __contains__(self, code: object) -> bool:
        return code in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def codes(self) -> list[int]:
        return sorted(self.entries)

    def lookup(self, code: int) -> XidInfo:
        """The entry for `code`; a code the catalog does not know gets the `unknown` entry with that code."""
        info = self.entries.get(code)
        if info is not None:
            return info
        return replace(self.unknown, code=code, name=f"{self.unknown.name} {code}")

    def is_fatal(self, code: int) -> bool:
        return self.lookup(code).severity == "fatal"

    def xid154_action(self, detail: str) -> Optional[str]:
        """The gpuguard action named by an Xid 154 message ('... to 0x2 (Node Reboot Required)'), or None."""
        m = _XID154_TARGET.search(detail or "")
        if not m:
            return None
        label = (m.group(2) or "").strip().lower()
        for known, action in self.xid154_by_label.items():
            if known.lower() == label:
                return action
        try:
            return self.xid154_by_value.get(int(m.group(1), 0))
        except ValueError:
            return None

    def resolve(self, code: int, detail: str = "") -> XidInfo:
        """Like `lookup`, but uses the event's message where it decides the action: Xid 154 names the recovery
        action, Xids 144-150 carry the driver's Fatal/Nonfatal verdict."""
        info = self.lookup(code)
        if info.source == "override":
            return info
        if code in NVLINK5_CODES:
            decoded = decode_nvlink5(detail)
            if decoded is None:
                return info  # no severity token: keep the catalog's entry
            unit, fatal, link = decoded
            where = f" on link {link}" if link is not None and link >= 0 else ""
            if fatal:
                return replace(info, severity="fatal", action="reset",
                               note=f"The driver reported {unit} as Fatal{where}: NVIDIA's decode sheet maps Fatal "
                                    f"NVLink5 events to RESET_GPU.")
            return replace(info, severity="warn", action="none",
                           note=f"The driver reported {unit} as Nonfatal{where}: NVIDIA's decode sheet maps Nonfatal "
                                f"NVLink5 events to IGNORE; recorded, the node stays in service.")
        if code != 154:
            return info
        action = self.xid154_action(detail)
        if action is None:
            return info  # unparseable: keep the catalog's fail-closed entry
        severity = "fatal" if action != "none" else "info"
        return replace(info, action=action, severity=severity,
                       note=f"Action taken from the Xid 154 message ({detail.strip()[:80]}).")

    def explain(self, code: int) -> str:
        """Multi-line human text for `gpuguard xid explain CODE`."""
        return explain_entry(self, self.lookup(code))


def explain_entry(catalog: XidCatalog, info: XidInfo) -> str:
    import textwrap  # only `explain` needs it; keep it off the prolog's import path

    wrap = textwrap.TextWrapper(width=100, subsequent_indent=" " * 15, break_on_hyphens=False,
                                break_long_words=False)

    def line(label: str, text: str) -> str:
        return wrap.fill(f"  {label + ':':<12} {text}")

    head = f"Xid {info.code}: {info.name}" + (f" ({info.mnemonic})" if info.mnemonic else "")
    out = [head, line("Severity", _SEVERITY_TEXT.get(info.severity, info.severity)),
           line("gpuguard", f"{info.action}: {_ACTION_TEXT.get(info.action, info.action)}")]
    if info.nvidia_action:
        meaning = catalog.buckets.get(info.nvidia_action, "")
        out.append(line("NVIDIA", f"{info.nvidia_action}" + (f" ({meaning})" if meaning else "")))
    else:
        out.append(line("NVIDIA", "no resolution bucket listed"))
    out.append(line("Recommended", info.nvidia_action_text))
    if info.nvidia_investigatory:
        out.append(line("Investigate", info.nvidia_investigatory))
    out.append(line("What", info.description))
    if info.causes:
        out.append(line("Causes", ", ".join(info.causes)))
    if info.note:
        out.append(line("Note", info.note))
    origin = {"override": "site config (xid.overrides) over gpuguard's catalog",
              "unknown": "gpuguard's default for codes missing from its catalog"}.get(info.source, "gpuguard's catalog")
    out.append(line("Source", f"{origin}; NVIDIA's Xid catalog: {NVIDIA_CATALOG_URL}"))
    return "\n".join(out)
