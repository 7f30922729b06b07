"""Environment presets: (instance type, software stack) -> the variables a job exports, each with why.

The data is `data/presets.yaml` (sources in its header); a site adds or overrides instances, stacks and common
variables under `templates.presets` in its config. Everything here is pure: load, merge, validate, resolve.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from gpuguard.config.yamlutil import load_yaml_file


PRESETS_PATH = Path(__file__).resolve().parent / "data" / "presets.yaml"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
UNDER = ("job_dir", "attempt_dir", "local_dir")
VERSION_KEYS = ("libfabric", "aws_ofi_nccl", "efa_installer", "nccl")
_CMP = re.compile(r"^\s*(==|>=|<=|<|>)?\s*(.+)$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PresetError(ValueError):
    """Unknown preset or stack, or a malformed preset definition; the message says which and what is known."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: Optional[str]  # None: unset it
    why: str
    under: Optional[str] = None  # job_dir | attempt_dir | local_dir: value is a path below that runtime directory
    source: str = "common"  # common | stack | instance | site | job | template

    @property
    def why_lines(self) -> list[str]:
        return textwrap.wrap(self.why, width=108) or [""]


@dataclass(frozen=True)
class Preset:
    instance: str
    stack: str
    fabric: str
    description: str
    stack_description: str
    env: tuple[EnvVar, ...]
    unset: tuple[EnvVar, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)  # known-bad or below-recommended versions

    @property
    def label(self) -> str:
        return f"{self.instance} / {self.stack}"


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


@lru_cache(maxsize=1)
def _shipped() -> dict[str, Any]:
    data = load_yaml_file(PRESETS_PATH)
    if not isinstance(data, dict):
        raise PresetError(f"{PRESETS_PATH}: expected a mapping")
    return data


def load_presets(site: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The shipped presets with the site's `templates.presets` merged over them (instances/stacks by name;
    `common.env` entries replace same-named ones), validated."""
    data = _deep_merge(_shipped(), {k: v for k, v in (site or {}).items() if k != "common"})
    if site and "common" in site:
        extra = _env_list(site["common"].get("env", []) if isinstance(site["common"], Mapping) else None,
                          "templates.presets.common.env", "site")
        names = {e.name for e in extra}
        data["common"] = {"env": [e for e in data["common"]["env"] if e["name"] not in names]
                          + [dict(name=e.name, value=e.value, why=e.why, under=e.under) for e in extra]}
    validate_presets(data)
    return data


def _env_list(raw: Any, where: str, source: str, unset: bool = False) -> list[EnvVar]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise PresetError(f"{where}: expected a list of {{name, value, why}}")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise PresetError(f"{at}: expected a mapping with name, value and why")
        unknown = set(item) - {"name", "value", "why", "under"}
        if unknown:
            raise PresetError(f"{at}: unknown keys {sorted(unknown)}; known: name, value, why, under")
        name, why = item.get("name"), item.get("why")
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise PresetError(f"{at}: name must be a shell variable name, got {name!r}")
        if not isinstance(why, str) or not why.strip() or _CONTROL.search(why):
            raise PresetError(f"{at} ({name}): every variable needs a one-line 'why'")
        value = item.get("value")
        if unset:
            value = None
        else:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise PresetError(f"{at} ({name}): value must be a string or number, got {value!r}")
            value = str(value)
            if _CONTROL.search(value):
                raise PresetError(f"{at} ({name}): control characters (newline, tab, ...) are not allowed in a value")
        under = item.get("under")
        if under is not None and under not in UNDER:
            raise PresetError(f"{at} ({name}): under must be one of {', '.join(UNDER)}, got {under!r}")
        out.append(EnvVar(name=name, value=value, why=why.strip(), under=under, source=source))
    return out


def validate_presets(data: Mapping[str, Any]) -> None:
    for key in ("common", "stacks", "instances"):
        if not isinstance(data.get(key), Mapping):
            raise PresetError(f"presets: '{key}' must be a mapping")
    _env_list(data["common"].get("env"), "common.env", "common")
    for name, st in data["stacks"].items():
        if not isinstance(st, Mapping) or st.get("fabric") not in ("efa", "ib", "none"):
            raise PresetError(f"stacks.{name}: needs fabric: efa | ib | none")
        _env_list(st.get("env"), f"stacks.{name}.env", "stack")
        _env_list(st.get("unset"), f"stacks.{name}.unset", "stack", unset=True)
    for name, inst in data["instances"].items():
        if not isinstance(inst, Mapping) or not isinstance(inst.get("stacks"), list) or not inst["stacks"]:
            raise PresetError(f"instances.{name}: needs a non-empty list of stacks")
        for s in inst["stacks"]:
            if s not in data["stacks"]:
                raise PresetError(f"instances.{name}: unknown stack {s!r}; known: {', '.join(data['stacks'])}")
        _env_list(inst.get("env"), f"instances.{name}.env", "instance")
        for key, minimum in (inst.get("min_versions") or {}).items():
            _check_version_key(key, f"instances.{name}.min_versions")
            _version(minimum, key)
        for key, rec in (inst.get("recommended_versions") or {}).items():
            _check_version_key(key, f"instances.{name}.recommended_versions")
            if not isinstance(rec, Mapping) or "version" not in rec or not rec.get("why"):
                raise PresetError(f"instances.{name}.recommended_versions.{key}: needs version and why")
            _version(rec["version"], key)
    bad = data.get("known_bad") or []
    if not isinstance(bad, list):
        raise PresetError("known_bad: expected a list of {when, why[, set]}")
    for i, item in enumerate(bad):
        at = f"known_bad[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("when"), Mapping) or not item["when"] \
                or not isinstance(item.get("why"), str) or set(item) - {"when", "why", "set"}:
            raise PresetError(f"{at}: expected {{when: {{key: condition}}, why: text[, set: {{NAME: value}}]}}")
        for key, cond in item["when"].items():
            _check_version_key(key, f"{at}.when")
            _condition(cond, f"{at}.when.{key}")
        for env_name, value in (item.get("set") or {}).items():
            if not ENV_NAME.match(str(env_name)) or isinstance(value, bool) or not isinstance(value, (str, int)):
                raise PresetError(f"{at}.set: {env_name!r}: expected NAME: value")


def _check_version_key(key: Any, where: str) -> None:
    if key not in VERSION_KEYS:
        raise PresetError(f"{where}: unknown component {key!r}; known: {', '.join(VERSION_KEYS)}")


def list_presets(site: Optional[Mapping[str, Any]] = None) -> dict[str, dict[str, Any]]:
    return dict(load_presets(site)["instances"])


def _version(text: Any, what: str) -> tuple[int, ...]:
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(text))
    if not m:
        raise PresetError(f"stack.{what}: not a version number: {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def _vcmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Compare versions padding with zeros (1.14 == 1.14.0)."""
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


def _condition(cond: Any, where: str) -> tuple[str, tuple[int, ...]]:
    m = _CMP.match(str(cond))
    if not m:
        raise PresetError(f"{where}: expected a condition such as '<1.29.1' or '==1.14.0', got {cond!r}")
    return m.group(1) or "==", _version(m.group(2), where)


def _holds(op: str, have: tuple[int, ...], ref: tuple[int, ...]) -> bool:
    c = _vcmp(have, ref)
    return {"==": c == 0, ">=": c >= 0, "<=": c <= 0, "<": c < 0, ">": c > 0}[op]


def stack_for_versions(versions: Mapping[str, Any]) -> str:
    """AWS's EFA cheatsheet, section 3: which preset a given libfabric / aws-ofi-nccl pair needs."""
    unknown = set(versions) - set(VERSION_KEYS)
    if unknown:
        raise PresetError(f"stack: unknown keys {sorted(unknown)}; give versions of {', '.join(VERSION_KEYS)}")
    if "aws_ofi_nccl" not in versions:
        raise PresetError("stack: the aws_ofi_nccl version is needed to pick an EFA preset")
    ofi = _version(versions["aws_ofi_nccl"], "aws_ofi_nccl")
    fabric = _version(versions["libfabric"], "libfabric") if "libfabric" in versions else None
    if _vcmp(ofi, (1, 6)) < 0:
        return "efa-ofi-1.5"
    if _vcmp(ofi, (1, 7)) < 0 or (fabric is not None and _vcmp(fabric, (1, 18)) < 0):
        return "efa-ofi-1.6"
    return "efa"


def version_findings(data: Mapping[str, Any], instance: str, versions: Mapping[str, Any]) -> \
        tuple[list[str], list[str], list[EnvVar]]:
    """(errors, warnings, extra environment) for the stack `versions` on `instance`: below the instance's minimum
    versions is an error, below its recommended versions or matching a known-bad combination a warning (some
    known-bad combinations have a workaround variable, returned as extra environment). Pure."""
    inst = data["instances"][instance]
    have = {k: _version(v, k) for k, v in versions.items()}
    errors: list[str] = []
    warnings: list[str] = []
    extra: list[EnvVar] = []
    for key, minimum in (inst.get("min_versions") or {}).items():
        if key in have and _vcmp(have[key], _version(minimum, key)) < 0:
            errors.append(f"stack: {instance} needs {key.replace('_', '-')} >= {minimum}, got {versions[key]}")
    for key, rec in (inst.get("recommended_versions") or {}).items():
        if key in have and _vcmp(have[key], _version(rec["version"], key)) < 0:
            warnings.append(f"{key.replace('_', '-')} {versions[key]} on {instance}: {rec['why']}; "
                            f"use {rec['version']} or later")
    for i, item in enumerate(data.get("known_bad") or []):
        conds = [(k, *_condition(c, f"known_bad[{i}].when.{k}")) for k, c in item["when"].items()]
        if all(k in have and _holds(op, have[k], ref) for k, op, ref in conds):
            warnings.append(item["why"])
            for name, value in (item.get("set") or {}).items():
                extra.append(EnvVar(name=str(name), value=str(value), why=item["why"], source="stack"))
    return errors, warnings, extra


def resolve_preset(instance: str, stack: Union[None, str, Mapping[str, Any]] = None,
                   site: Optional[Mapping[str, Any]] = None) -> Preset:
    """The preset for `instance` (a profile / instance type name) on `stack` (a stack name, a mapping of
    versions {libfabric, aws_ofi_nccl, efa_installer, nccl}, or None for the instance's first stack)."""
    data = load_presets(site)
    instances, stacks = data["instances"], data["stacks"]
    if instance not in instances:
        close = difflib.get_close_matches(instance, list(instances), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise PresetError(f"preset: unknown instance type {instance!r}{hint}; known: {', '.join(instances)}")
    inst = instances[instance]
    warnings: list[str] = []
    extra: list[EnvVar] = []
    if stack is None:
        stack_name = inst["stacks"][0]
    elif isinstance(stack, Mapping):
        if inst.get("fabric") != "efa":
            raise PresetError(f"stack: version selection is for EFA instances; {instance} uses "
                              f"{', '.join(inst['stacks'])}")
        stack_name = stack_for_versions(stack)
        errors, warnings, extra = version_findings(data, instance, stack)
        if errors:
            raise PresetError(errors[0] + " (aws-ofi-nccl release notes / AWS EFA cheatsheet)")
    elif isinstance(stack, str):
        stack_name = stack
    else:
        raise PresetError(f"stack: expected a stack name or {{libfabric, aws_ofi_nccl}} versions, got {stack!r}")
    if stack_name not in inst["stacks"]:
        raise PresetError(f"stack: {stack_name!r} is not supported on {instance}; supported: "
                          f"{', '.join(inst['stacks'])}")
    st = stacks[stack_name]
    env: dict[str, EnvVar] = {}
    for e in (_env_list(data["common"].get("env"), "common.env", "common")
              + _env_list(st.get("env"), f"stacks.{stack_name}.env", "stack")
              + _env_list(inst.get("env"), f"instances.{instance}.env", "instance") + extra):
        env[e.name] = e  # later (more specific) wins
    unset = tuple(e for e in _env_list(st.get("unset"), f"stacks.{stack_name}.unset", "stack", unset=True)
                  if e.name not in env)
    return Preset(instance=instance, stack=stack_name, fabric=str(st["fabric"]),
                  description=str(inst.get("description", "")), stack_description=str(st.get("description", "")),
                  env=tuple(env.values()), unset=unset, warnings=tuple(warnings))


def job_env(values: Mapping[str, Any], where: str = "env") -> list[EnvVar]:
    """A job's own `env:` mapping (NAME: value) as EnvVars; they come after (and override) the preset's."""
    if not isinstance(values, Mapping):
        raise PresetError(f"{where}: expected a mapping of NAME: value")
    out = []
    for name, value in values.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise PresetError(f"{where}: {name!r} is not a shell variable name")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise PresetError(f"{where}.{name}: expected a string or number, got {value!r}")
        out.append(EnvVar(name=name, value=str(value), why="set by the job", source="job"))
    return out
