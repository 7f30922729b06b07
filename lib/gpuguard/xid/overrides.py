"""Site overrides of the Xid catalog (`xid: {overrides: {94: {severity: fatal}}}` in the config): applied to a
loaded catalog, severity and action kept coherent, every mistake an XidCatalogError naming the code and key."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Union

from gpuguard.util.record import replace
from gpuguard.xid.entries import ACTIONS, OVERRIDE_KEYS, SEVERITIES, XidCatalog, XidCatalogError, XidInfo
from gpuguard.xid.validate import check_choice, check_coherent



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
        check_choice(where, "severity", settings["severity"], SEVERITIES)
    if "action" in settings:
        check_choice(where, "action", settings["action"], ACTIONS)
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
    check_coherent(where, severity, action)
    changes = {k: settings[k] for k in ("note", "name", "description", "nvidia_action_text") if k in settings}
    return replace(info, severity=severity, action=action, source=source, **changes)
