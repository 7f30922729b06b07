"""The site's config file loaded and validated against the check registry: what every command and hook calls.

gpuguard.config is the bottom of the package (the typed sections, validation, the last good copy) and imports no
feature, so it takes the checks' parameters (`checks:` check id -> {param: validator name}) from its caller. This
module, one layer above the checks, gives it the registry's: `load_config`, `parse_config`, `load_guarded` and
`check_file` are gpuguard.config.schema's and gpuguard.config.lastgood's with the registry bound. The registry is
built only when a file is really parsed: the hooks' hot path reads the compiled copy and never pays for it.
"""

from __future__ import annotations

from typing import Optional

from gpuguard.config import lastgood, schema
from gpuguard.config.schema import CheckParams, Config, ConfigIssue


def check_params() -> CheckParams:
    """check id -> {param: validator name}, from the check registry (gpuguard.checks, `CheckSpec.params`)."""
    from gpuguard.checks import param_schema

    return param_schema()


def parse_config(text: str, source: str = "<string>", lenient: bool = False) -> Config:
    """YAML text validated into a Config (strict: ConfigError at the first problem; `lenient`: every problem in
    `Config.issues`)."""
    return schema.parse_config(text, source, check_params=check_params(), lenient=lenient)


def load_config(explicit: Optional[str] = None) -> Config:
    """The file (`--config`, $GPUGUARD_CONFIG or the default path) validated strictly."""
    return schema.load_config(explicit, check_params=check_params())


def load_guarded(explicit: Optional[str] = None, directory: Optional[str] = None,
                 read_timeout_s: float = 10.0) -> Config:
    """The config to run with, never a ConfigError (gpuguard.config.lastgood)."""
    return lastgood.load_guarded(explicit, directory, read_timeout_s, check_params=check_params)


def check_file(path: str) -> list[ConfigIssue]:
    """Every problem of a config file (`gpuguard config --check`)."""
    return lastgood.check_file(path, check_params=check_params())
