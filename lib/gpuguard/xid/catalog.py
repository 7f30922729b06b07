"""The Xid catalog: what an NVIDIA Xid means and what gpuguard does about it on the node.

The data lives in `xid_catalog.yaml` (built from NVIDIA's Xid catalog, sources in its header); this module
only loads, validates and queries it. Sites adjust entries with overrides from their config
(`xid: {overrides: {94: {severity: fatal}}}`), never by editing the file.

Loading is on the prolog's path (every job), so it must be cheap. Parsing the 90 KB YAML with libyaml takes about
9 ms, so the parsed data is also shipped as a generated module (`catalog_data.py`, about 0.4 ms to import from
its .pyc) stamped with the size and CRC-32 of the YAML it came from. `load_catalog` reads and checksums the YAML
(0.1 ms) and uses the generated data only when both match, so the YAML stays the single source of truth: an edited
YAML is parsed, never silently ignored. (CRC-32, not SHA-256: this detects staleness, not tampering, and importing
hashlib alone costs 2 ms.) Regenerate after editing the YAML with `python -m gpuguard.xid.catalog regen`; a unit test fails
until you do.
"""

from __future__ import annotations

import re
import sys
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

CATALOG_PATH = Path(__file__).resolve().parent / "xid_catalog.yaml"
GENERATED_PATH = Path(__file__).resolve().parent / "catalog_data.py"
NVIDIA_CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

SEVERITIES = ("fatal", "app", "warn", "info")
ACTIONS = ("none", "drain", "reset", "reboot", "replace")  # least to most invasive, as gpuguard.model.Action
CAUSES = ("hw", "driver", "user_app", "system_memory", "bus", "thermal", "fb_corruption")

# What a site may change per code (or for `unknown`). Codes, NVIDIA's bucket and causes are facts, not policy.
OVERRIDE_KEYS = ("severity", "action", "note", "name", "description", "nvidia_action_text")

_ENTRY_REQUIRED = ("mnemonic", "name", "description", "nvidia_action", "nvidia_action_text", "severity", "action",
                   "causes")
_ENTRY_OPTIONAL = ("nvidia_investigatory", "note")
_UNKNOWN_REQUIRED = ("name", "description", "nvidia_action", "nvidia_action_text", "severity", "action", "causes")

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


@dataclass(frozen=True)
class XidInfo:
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


@dataclass(frozen=True)
class XidCatalog:
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
        return _explain(self, self.lookup(code))


# --------------------------------------------------------------------------- loading


def load_catalog(overrides: Optional[Mapping[Any, Mapping[str, Any]]] = None,
                 path: Union[str, Path, None] = None) -> XidCatalog:
    """The catalog at `path` (default: the shipped one) with site `overrides` applied.

    `overrides` maps an Xid code (int, or a string of digits) or "unknown" to a mapping of OVERRIDE_KEYS, e.g.
    `{94: {"severity": "fatal"}, "unknown": {"severity": "warn"}}`. Severity and action stay coherent: raising a
    code to fatal without naming an action drains (`drain`); lowering it below fatal without naming one sets
    `none`. An override for a code the catalog lacks adds it. Raises XidCatalogError naming the code and key.
    """
    base = _load_base(Path(path) if path is not None else CATALOG_PATH)
    if not overrides:
        return base
    return apply_overrides(base, overrides)


_BASE_CACHE: dict[tuple[str, str], XidCatalog] = {}


def _load_base(path: Path) -> XidCatalog:
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise XidCatalogError(f"{path}: cannot read the Xid catalog: {e.strerror}") from None
    digest = _fingerprint(blob)
    key = (str(path), digest)
    cached = _BASE_CACHE.get(key)
    if cached is None:
        cached = _build(_raw_data(blob, digest, str(path)), str(path))
        _BASE_CACHE[key] = cached
    return cached


def _raw_data(blob: bytes, digest: str, source: str) -> Any:
    try:
        from gpuguard.xid import catalog_data as generated
    except ImportError:  # pragma: no cover - a checkout without the generated module
        generated = None
    if generated is not None and getattr(generated, "YAML_FINGERPRINT", None) == digest:
        return generated.DATA
    return _parse_yaml(blob, source)


def _fingerprint(blob: bytes) -> str:
    return f"{len(blob)}:{zlib.crc32(blob):08x}"


def _parse_yaml(blob: bytes, source: str) -> Any:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(blob, Loader=loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise XidCatalogError(f"{source}: {where}{getattr(e, 'problem', None) or e}") from None


def _build(data: Any, source: str) -> XidCatalog:
    if not isinstance(data, dict):
        raise XidCatalogError(f"{source}: expected a mapping with 'version' and 'xids'")
    if data.get("version") != 1:
        raise XidCatalogError(f"{source}: version: expected 1, got {data.get('version')!r}")
    buckets = _build_buckets(data.get("buckets") or {}, source)
    xids = data.get("xids")
    if not isinstance(xids, dict) or not xids:
        raise XidCatalogError(f"{source}: xids: expected a non-empty mapping of code -> entry")
    entries: dict[int, XidInfo] = {}
    for code, raw in xids.items():
        if isinstance(code, bool) or not isinstance(code, int) or code <= 0:
            raise XidCatalogError(f"{source}: xids.{code}: keys must be positive integers (Xid codes)")
        entries[code] = _entry(code, raw, f"{source}: xids.{code}", _ENTRY_REQUIRED, buckets)
    unknown = _entry(0, data.get("unknown"), f"{source}: unknown", _UNKNOWN_REQUIRED, buckets, source="unknown")
    by_label, by_value = _build_xid154(data.get("xid154_recovery_actions") or {}, source)
    return XidCatalog(entries=MappingProxyType(entries), unknown=unknown, buckets=MappingProxyType(buckets),
                      xid154_by_label=MappingProxyType(by_label), xid154_by_value=MappingProxyType(by_value),
                      path=source)


def _build_buckets(raw: Any, source: str) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise XidCatalogError(f"{source}: buckets: expected a mapping")
    out: dict[str, str] = {}
    for name, spec in raw.items():
        where = f"{source}: buckets.{name}"
        if not isinstance(spec, dict) or not isinstance(spec.get("meaning"), str):
            raise XidCatalogError(f"{where}: expected a mapping with 'meaning', 'action' and 'severities'")
        _check_choice(where, "action", spec.get("action"), ACTIONS)
        sevs = spec.get("severities")
        if not isinstance(sevs, list) or not sevs:
            raise XidCatalogError(f"{where}: severities: expected a non-empty list")
        for s in sevs:
            _check_choice(where, "severities", s, SEVERITIES)
        out[str(name)] = spec["meaning"]
    return out


def _build_xid154(raw: Any, source: str) -> tuple[dict[str, str], dict[int, str]]:
    where = f"{source}: xid154_recovery_actions"
    if not isinstance(raw, dict):
        raise XidCatalogError(f"{where}: expected a mapping with 'by_label' and 'by_value'")
    by_label = raw.get("by_label") or {}
    by_value = raw.get("by_value") or {}
    if not isinstance(by_label, dict) or not isinstance(by_value, dict):
        raise XidCatalogError(f"{where}: by_label and by_value must be mappings")
    for k, v in list(by_label.items()) + list(by_value.items()):
        _check_choice(f"{where}.{k}", "action", v, ACTIONS)
    return {str(k): v for k, v in by_label.items()}, {int(k): v for k, v in by_value.items()}


def _entry(code: int, raw: Any, where: str, required: tuple[str, ...], buckets: Mapping[str, str],
           source: str = "catalog") -> XidInfo:
    if not isinstance(raw, dict):
        raise XidCatalogError(f"{where}: expected a mapping")
    allowed = set(_ENTRY_REQUIRED) | set(_ENTRY_OPTIONAL)
    for key in raw:
        if key not in allowed:
            raise XidCatalogError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(allowed))})")
    for key in required:
        if key not in raw:
            raise XidCatalogError(f"{where}: missing key '{key}'")
    for key in ("mnemonic", "name", "description", "nvidia_action", "nvidia_action_text", "nvidia_investigatory",
                "note"):
        if key in raw and not isinstance(raw[key], str):
            raise XidCatalogError(f"{where}: {key}: expected a string, got {type(raw[key]).__name__}")
    if not raw["name"].strip():
        raise XidCatalogError(f"{where}: name: must not be empty")
    if raw["nvidia_action"] and buckets and raw["nvidia_action"] not in buckets:
        raise XidCatalogError(f"{where}: nvidia_action: '{raw['nvidia_action']}' is not a bucket listed under "
                              f"'buckets' ({', '.join(sorted(buckets))})")
    _check_choice(where, "severity", raw["severity"], SEVERITIES)
    _check_choice(where, "action", raw["action"], ACTIONS)
    _check_coherent(where, raw["severity"], raw["action"])
    causes = raw["causes"]
    if not isinstance(causes, list):
        raise XidCatalogError(f"{where}: causes: expected a list")
    for c in causes:
        _check_choice(where, "causes", c, CAUSES)
    return XidInfo(code=code, name=raw["name"], description=raw["description"], nvidia_action=raw["nvidia_action"],
                   nvidia_action_text=raw["nvidia_action_text"], severity=raw["severity"], action=raw["action"],
                   causes=tuple(causes), note=raw.get("note", ""), mnemonic=raw.get("mnemonic", ""),
                   nvidia_investigatory=raw.get("nvidia_investigatory", ""), source=source)


def _check_choice(where: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise XidCatalogError(f"{where}: {key}: {value!r} is not one of {', '.join(choices)}")


def _check_coherent(where: str, severity: str, action: str) -> None:
    # The prolog's contract: fatal means the node is drained, so it must name what fixes it; anything else
    # leaves the node in service, so it must not ask for a drain/reset/reboot/replace.
    if severity == "fatal" and action == "none":
        raise XidCatalogError(f"{where}: severity 'fatal' needs an action other than 'none' "
                              f"({', '.join(ACTIONS[1:])})")
    if severity != "fatal" and action != "none":
        raise XidCatalogError(f"{where}: action '{action}' takes the node out of service, so severity must be "
                              f"'fatal' (got '{severity}')")


# --------------------------------------------------------------------------- overrides


def apply_overrides(catalog: XidCatalog, overrides: Mapping[Any, Mapping[str, Any]]) -> XidCatalog:
    """A new catalog with site overrides applied (see `load_catalog`)."""
    if not isinstance(overrides, Mapping):
        raise XidCatalogError(f"xid overrides: expected a mapping of Xid code -> settings, "
                              f"got {type(overrides).__name__}")
    entries = dict(catalog.entries)
    unknown = catalog.unknown
    for key, settings in overrides.items():
        code = _override_code(key)
        where = f"xid override {key}"
        if code == "unknown":
            unknown = _overridden(unknown, settings, where, "unknown")
        elif code in entries:
            entries[code] = _overridden(entries[code], settings, where, "override")
        else:  # a code newer than the catalog: the site describes it
            base = replace(catalog.unknown, code=code, name=f"Xid {code} (site-defined)",
                           note="Not in gpuguard's catalog; defined by site config.")
            entries[code] = _overridden(base, settings, where, "override")
    return replace(catalog, entries=MappingProxyType(entries), unknown=unknown)


def _override_code(key: Any) -> Union[int, str]:
    if key == "unknown":
        return "unknown"
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or key <= 0:
        raise XidCatalogError(f"xid override {key!r}: keys must be Xid codes (positive integers) or 'unknown'")
    return key


def _overridden(info: XidInfo, settings: Any, where: str, source: str) -> XidInfo:
    if not isinstance(settings, Mapping):
        raise XidCatalogError(f"{where}: expected a mapping like {{severity: fatal, action: reboot}}, "
                              f"got {type(settings).__name__}")
    for key in settings:
        if key not in OVERRIDE_KEYS:
            raise XidCatalogError(f"{where}: unknown key '{key}' (allowed: {', '.join(sorted(OVERRIDE_KEYS))})")
    for key in ("note", "name", "description", "nvidia_action_text"):
        if key in settings and not isinstance(settings[key], str):
            raise XidCatalogError(f"{where}: {key}: expected a string, got {type(settings[key]).__name__}")
    if "severity" in settings:
        _check_choice(where, "severity", settings["severity"], SEVERITIES)
    if "action" in settings:
        _check_choice(where, "action", settings["action"], ACTIONS)
    severity = settings.get("severity", info.severity)
    action = settings.get("action", info.action)
    if "severity" in settings and "action" not in settings:
        if severity == "fatal" and action == "none":
            action = "drain"
        elif severity != "fatal":
            action = "none"
    elif "action" in settings and "severity" not in settings:
        if action != "none":
            severity = "fatal"
        elif severity == "fatal":
            severity = "warn"
    _check_coherent(where, severity, action)
    changes = {k: settings[k] for k in ("note", "name", "description", "nvidia_action_text") if k in settings}
    return replace(info, severity=severity, action=action, source=source, **changes)


# --------------------------------------------------------------------------- explain


def explain(code: int, catalog: Optional[XidCatalog] = None) -> str:
    """Multi-line human text about one Xid, from `catalog` (default: the shipped catalog, no overrides)."""
    return (catalog or load_catalog()).explain(code)


def _explain(catalog: XidCatalog, info: XidInfo) -> str:
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


# --------------------------------------------------------------------------- generated module


def generated_module_source(path: Union[str, Path, None] = None) -> str:
    """Python source of `catalog_data.py` for the YAML at `path` (validated first)."""
    import pprint

    p = Path(path) if path is not None else CATALOG_PATH
    blob = p.read_bytes()
    data = _parse_yaml(blob, str(p))
    _build(data, str(p))  # never ship data the loader would reject
    return ("# Generated from xid_catalog.yaml by `python -m gpuguard.xid.catalog regen`. Do not edit: edit the YAML.\n"
            "# The loader uses DATA only while YAML_FINGERPRINT (size:crc32) matches the YAML, else parses the YAML.\n"
            "# flake8: noqa\n"
            f"YAML_FINGERPRINT = {_fingerprint(blob)!r}\n"
            f"DATA = {pprint.pformat(data, width=118, sort_dicts=False)}\n")


def _main(argv: list[str]) -> int:
    if argv[:1] == ["regen"]:
        GENERATED_PATH.write_text(generated_module_source(), encoding="utf-8")
        print(f"wrote {GENERATED_PATH}")
        return 0
    if len(argv) == 2 and argv[0] == "explain" and argv[1].isdigit():
        print(explain(int(argv[1])))
        return 0
    print("usage: python -m gpuguard.xid.catalog regen | explain CODE", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main(sys.argv[1:]))
