"""Validating an Xid catalog's data (from the YAML or its generated module) into an XidCatalog: every entry complete,
every choice known, severity and action coherent. A bad file is an XidCatalogError naming the code and the key."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from gpuguard.xid.entries import ACTIONS, CAUSES, SEVERITIES, XidCatalog, XidCatalogError, XidInfo

ENTRY_REQUIRED = ("mnemonic", "name", "description", "nvidia_action", "nvidia_action_text", "severity", "action",
                   "causes")
ENTRY_OPTIONAL = ("nvidia_investigatory", "note")
UNKNOWN_REQUIRED = ("name", "description", "nvidia_action", "nvidia_action_text", "severity", "action", "causes")


def build_catalog(data: Any, source: str) -> XidCatalog:
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
        entries[code] = _entry(code, raw, f"{source}: xids.{code}", ENTRY_REQUIRED, buckets)
    unknown = _entry(0, data.get("unknown"), f"{source}: unknown", UNKNOWN_REQUIRED, buckets, source="unknown")
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
        check_choice(where, "action", spec.get("action"), ACTIONS)
        sevs = spec.get("severities")
        if not isinstance(sevs, list) or not sevs:
            raise XidCatalogError(f"{where}: severities: expected a non-empty list")
        for s in sevs:
            check_choice(where, "severities", s, SEVERITIES)
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
        check_choice(f"{where}.{k}", "action", v, ACTIONS)
    return {str(k): v for k, v in by_label.items()}, {int(k): v for k, v in by_value.items()}


def _entry(code: int, raw: Any, where: str, required: tuple[str, ...], buckets: Mapping[str, str],
           source: str = "catalog") -> XidInfo:
    if not isinstance(raw, dict):
        raise XidCatalogError(f"{where}: expected a mapping")
    allowed = set(ENTRY_REQUIRED) | set(ENTRY_OPTIONAL)
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
    check_choice(where, "severity", raw["severity"], SEVERITIES)
    check_choice(where, "action", raw["action"], ACTIONS)
    check_coherent(where, raw["severity"], raw["action"])
    causes = raw["causes"]
    if not isinstance(causes, list):
        raise XidCatalogError(f"{where}: causes: expected a list")
    for c in causes:
        check_choice(where, "causes", c, CAUSES)
    return XidInfo(code=code, name=raw["name"], description=raw["description"], nvidia_action=raw["nvidia_action"],
                   nvidia_action_text=raw["nvidia_action_text"], severity=raw["severity"], action=raw["action"],
                   causes=tuple(causes), note=raw.get("note", ""), mnemonic=raw.get("mnemonic", ""),
                   nvidia_investigatory=raw.get("nvidia_investigatory", ""), source=source)


def check_choice(where: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise XidCatalogError(f"{where}: {key}: {value!r} is not one of {', '.join(choices)}")


def check_coherent(where: str, severity: str, action: str) -> None:
    # The prolog's contract: fatal means the node is drained, so it must name what fixes it; anything else
    # leaves the node in service, so it must not ask for a drain/reset/reboot/replace.
    if severity == "fatal" and action == "none":
        raise XidCatalogError(f"{where}: severity 'fatal' needs an action other than 'none' "
                              f"({', '.join(ACTIONS[1:])})")
    if severity != "fatal" and action != "none":
        raise XidCatalogError(f"{where}: action '{action}' takes the node out of service, so severity must be "
                              f"'fatal' (got '{severity}')")
