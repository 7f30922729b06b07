"""The `checks:` section: per-check settings. Each check declares its own parameters, with their validator names
and defaults, in its registry entry (gpuguard.checks, `CheckSpec.params`); this is the typed view of what the file
set for them, and the validators those names stand for.
"""

from __future__ import annotations

from typing import Any, Mapping

from gpuguard.config.fields import Section, Validator, boolean, choice, integer, number, section, str_list, string
from gpuguard.util.record import field


def disk_paths(x: Any) -> Any:
    """sys.disk paths: [{path, min_free_gib, root_owned}]; `root_owned: true` (only root writes there) is
    what lets a full filesystem drain the node."""
    if not isinstance(x, list):
        raise ValueError(f"expected a list of {{path, min_free_gib, root_owned}}, got {x!r}")
    out = []
    for i, item in enumerate(x):
        if not isinstance(item, dict) or set(item) - {"path", "min_free_gib", "root_owned"} or "path" not in item:
            raise ValueError(f"item {i}: expected {{path: ..., min_free_gib: ..., root_owned: ...}}, got {item!r}")
        if not isinstance(item["path"], str) or not item["path"].startswith("/"):
            raise ValueError(f"item {i}: path must be absolute, got {item['path']!r}")
        number(0, strict=False)(item.get("min_free_gib", 1))
        if not isinstance(item.get("root_owned", False), bool):
            raise ValueError(f"item {i}: root_owned must be true or false, got {item['root_owned']!r}")
        out.append({"path": item["path"], "min_free_gib": item.get("min_free_gib", 1),
                    "root_owned": item.get("root_owned", False)})
    return out


# Parameters every check accepts (validator name), beside the check's own (defaults live with the check registry).
COMMON_CHECK_PARAMS: dict[str, str] = {
    "enabled": "bool",  # false switches the check off fleet-wide, without a redeploy
}

# The validator names a CheckSpec's params use.
PARAM_VALIDATORS: dict[str, Validator] = {
    "int": integer(0),
    "int?": integer(0, allow_none=True),
    "num": number(0, strict=False),
    "num?": number(0, strict=False, allow_none=True),
    "bool": boolean,
    "str?": string(allow_none=True),
    "strlist": str_list,
    "disk_paths": disk_paths,
    "action": choice("drain", "reset", "reboot", "replace"),
    "severity": choice("fail", "warn"),
}


@section
class ChecksConfig(Section):
    """`checks:` what the file set for each check id (validated parameters; `gpu.nvlink: false` is
    {"enabled": False}). A check the file does not name runs with its registry defaults."""

    given: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def enabled(self, check_id: str) -> bool:
        return bool(self.given.get(check_id, {}).get("enabled", True))

    def params(self, check_id: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """The check's parameters: its registry defaults, overridden by what the file set."""
        params = dict(defaults)
        params.update({k: v for k, v in self.given.get(check_id, {}).items() if k != "enabled"})
        return params

    def with_param(self, check_id: str, name: str, value: Any) -> ChecksConfig:
        """A copy with one parameter of one check set (the last good value of a bad one)."""
        given = {k: dict(v) for k, v in self.given.items()}
        given.setdefault(check_id, {})[name] = value
        return ChecksConfig(given=given)

    def as_mapping(self) -> dict[str, dict[str, Any]]:
        """check id -> the parameters the file set (a copy), for display and the compiled configuration."""
        return {k: dict(v) for k, v in self.given.items()}
