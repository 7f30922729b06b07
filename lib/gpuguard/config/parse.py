"""Validating a config file against the section dataclasses (gpuguard.config.schema): every error names the file,
the line and the key path, an unknown key suggests the one it most likely misspells, a removed key says why.

Strict (the default) raises ConfigError at the first problem; lenient collects every problem in `Config.issues`
and leaves that key at its default, so one bad key never discards the rest of the file (gpuguard.config.lastgood
then gives it its last good value).
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any, Mapping, Optional

from gpuguard.config.checks import COMMON_CHECK_PARAMS, PARAM_VALIDATORS, ChecksConfig
from gpuguard.config.fields import Section, Validator, validator_of
from gpuguard.config.model import SECTIONS, Config, ConfigError, ConfigIssue
from gpuguard.config.yamlutil import Located, YamlError, check_yaml_expansion, load_yaml_located, strip_located


def section_keys(cls: type[Section]) -> dict[str, Validator]:
    """key -> validator of a section dataclass, in declaration order (what "known: ..." lists)."""
    return {f.name: validator_of(f) for f in fields(cls)}  # type: ignore[arg-type]


def removed_keys() -> dict[str, str]:
    """"section.key" -> why, for keys that existed once (a section's REMOVED)."""
    return {f"{name}.{k}": why for name, cls in SECTIONS.items() for k, why in getattr(cls, "REMOVED", {}).items()}


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _closest(key: str, options: list[str]) -> Optional[str]:
    close = difflib.get_close_matches(key, options, n=1)
    return close[0] if close else None


class _Issues:
    """Strict: the first problem raises ConfigError naming file, line and key. Lenient: every problem is
    collected."""

    def __init__(self, source: str, lenient: bool) -> None:
        self.source = source
        self.lenient = lenient
        self.found: list[ConfigIssue] = []

    def report(self, line: Optional[int], path: str, msg: str, meant: Optional[str] = None) -> None:
        if not self.lenient:
            raise ConfigError(f"{self.source}: {f'line {line}: ' if line else ''}{path}: {msg}")
        self.found.append(ConfigIssue(path, line, msg, meant))


def parse_text(text: str, source: str, check_params: Mapping[str, Mapping[str, str]], lenient: bool) -> Config:
    """gpuguard.config.schema.parse_config. `check_params`: the check registry's parameters (check id -> {param:
    validator name}), given by the caller: the config package sits below the checks (gpuguard.siteconfig binds
    the registry's)."""
    try:
        check_yaml_expansion(text, source)
        root = load_yaml_located(text, source)
    except YamlError as e:
        raise ConfigError(str(e)) from None
    if root is None:
        return Config(source=source)
    if not isinstance(root, Located):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    issues = _Issues(source, lenient)
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}  # what the file set validly
    checks: dict[str, dict[str, Any]] = {}
    given: set[str] = set()
    allowed = sorted(list(SECTIONS) + ["checks"])
    for section, value in root.value.items():
        line = root.lines.get(str(section))
        if section not in allowed:
            issues.report(line, str(section), f"unknown section{_suggest(str(section), allowed)}; known: "
                          f"{', '.join(allowed)}")
        elif value is None:
            continue
        elif not isinstance(value, Located):
            issues.report(line, str(section), "expected a mapping")
        elif section == "checks":
            _parse_checks(checks, given, value, issues, check_params)
        else:
            _parse_section(values[str(section)], given, str(section), value, issues)
    if values["xid"].get("overrides"):
        values["xid"]["overrides"] = _xid_overrides(values["xid"]["overrides"], root, issues)
    sections: dict[str, Any] = {name: SECTIONS[name](**v) for name, v in values.items()}
    cfg = Config(source=source, checks=ChecksConfig(given=checks), given=given, **sections)
    cfg.issues = issues.found
    cfg.mode = "partial" if issues.found else "ok"
    return cfg


def _parse_section(out: dict[str, Any], given: set[str], section: str, value: Located, issues: _Issues) -> None:
    schema = section_keys(SECTIONS[section])
    removed = removed_keys()
    for key, raw in value.value.items():
        kline = value.lines.get(str(key))
        path = f"{section}.{key}"
        if path in removed:
            issues.report(kline, path, removed[path])
            continue
        if key not in schema:
            meant = _closest(str(key), list(schema))
            issues.report(kline, path, f"unknown key{_suggest(str(key), list(schema))}; known: {', '.join(schema)}",
                          f"{section}.{meant}" if meant else None)
            continue
        try:
            out[key] = schema[key](strip_located(raw))
            given.add(path)
        except ValueError as e:
            issues.report(kline, path, str(e))


def _parse_checks(out: dict[str, dict[str, Any]], given: set[str], node: Located, issues: _Issues,
                  check_params: Mapping[str, Mapping[str, str]]) -> None:
    known = sorted(check_params)
    for check_id, raw in node.value.items():
        line = node.lines.get(str(check_id))
        path = f"checks.{check_id}"
        if check_id not in check_params:
            issues.report(line, path, f"unknown check{_suggest(str(check_id), known)}")
            continue
        if isinstance(raw, bool):  # shorthand: `gpu.nvlink: false`
            out[check_id] = {"enabled": raw}
            continue
        if raw is None:
            continue
        if not isinstance(raw, Located):
            issues.report(line, path, "expected a mapping of parameters or true/false")
            continue
        params: dict[str, Any] = {}
        spec = {**COMMON_CHECK_PARAMS, **check_params[check_id]}
        for key, value in raw.value.items():
            kline = raw.lines.get(str(key))
            if key not in spec:
                meant = _closest(str(key), list(spec))
                issues.report(kline, f"{path}.{key}", f"unknown parameter{_suggest(str(key), list(spec))}; known: "
                              f"{', '.join(sorted(spec))}", f"{path}.{meant}" if meant else None)
                continue
            try:
                params[key] = PARAM_VALIDATORS[spec[key]](strip_located(value))
                given.add(f"{path}.{key}")
            except ValueError as e:
                issues.report(kline, f"{path}.{key}", str(e))
        out[check_id] = params


def _xid_overrides(overrides: dict[Any, Any], root: Located, issues: _Issues) -> dict[Any, dict[str, Any]]:
    """The overrides checked against the Xid catalog: a bad code or entry is reported; if the catalog refuses
    them, none apply."""
    xid_node = root.value.get("xid")
    line = xid_node.lines.get("overrides") if isinstance(xid_node, Located) else None
    normalised: dict[Any, dict[str, Any]] = {}
    for code, value in overrides.items():
        if code != "unknown" and (isinstance(code, bool) or not isinstance(code, int)):
            issues.report(line, f"xid.overrides.{code}", "keys must be Xid codes (integers) or 'unknown'")
        elif not isinstance(value, dict):
            issues.report(line, f"xid.overrides.{code}", "expected a mapping like {severity: fatal, action: reboot}")
        else:
            normalised[code] = value
    try:
        from gpuguard.xid.catalog import load_catalog

        load_catalog(overrides=normalised)
    except (ValueError, KeyError) as e:
        issues.report(line, "xid.overrides", str(e))
        normalised = {}
    return normalised
