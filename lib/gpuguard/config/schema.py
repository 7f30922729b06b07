"""Site configuration: `/etc/gpuguard/config.yaml` (or `--config` / `$GPUGUARD_CONFIG`), as one typed `Config`.

Each section is a frozen dataclass (a feature's in gpuguard/config/sections/: `WatchConfig` in sections/watch.py,
...; the hook run's own sections in gpuguard/config/core.py); `Config` holds one of each as an attribute
(`cfg.deadlines.prolog_s`, `cfg.watch.start_at`, `cfg.checks.enabled("gpu.nvlink")`). This module is the one
place that assembles them; gpuguard.config.parse validates a file against them, and an error names the key path
*and* the line, e.g. ``/etc/gpuguard/config.yaml: line 7: deadlines.prolog_s: expected a number > 0, got 'soon'``.
Every check can be switched off fleet-wide (`checks.<id>.enabled: false`) without a redeploy.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from gpuguard.config.model import (DEFAULT_CONFIG_PATH, ENV_CONFIG, SECTIONS, Config, ConfigError, ConfigIssue,
                                   config_from_mapping, default_config)

__all__ = ["DEFAULT_CONFIG_PATH", "ENV_CONFIG", "SECTIONS", "CheckParams", "Config", "ConfigError", "ConfigIssue",
           "config_from_mapping", "default_config", "parse_config", "config_path", "load_config"]


CheckParams = Mapping[str, Mapping[str, str]]  # check id -> {param: validator name}: the check registry's


def parse_config(text: str, source: str = "<string>", *, check_params: CheckParams, lenient: bool = False) -> Config:
    """Validate YAML text into a Config. `check_params`: the check registry's parameters, from the caller (this
    package sits below the checks; gpuguard.siteconfig.parse_config gives the registry's). `lenient`: collect
    every problem in `Config.issues` instead of raising at the first (a file that is not YAML, or not a mapping,
    still raises: there are no keys to keep). The parser (YAML, suggestions) is imported only when a file is really
    parsed: the hooks' hot path reads the compiled copy (gpuguard.config.lastgood)."""
    from gpuguard.config.parse import parse_text

    return parse_text(text, source, check_params, lenient)


def config_path(explicit: Optional[str] = None) -> tuple[str, bool]:
    """(path, must_exist): an explicit path or $GPUGUARD_CONFIG must exist; the default may be absent."""
    if explicit:
        return explicit, True
    env = os.environ.get(ENV_CONFIG)
    if env:
        return env, True
    return DEFAULT_CONFIG_PATH, False


def load_config(explicit: Optional[str] = None, *, check_params: CheckParams) -> Config:
    """The file validated strictly (ConfigError at its first problem; gpuguard.siteconfig.load_config gives the
    registry's `check_params`)."""
    path, must_exist = config_path(explicit)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if must_exist:
            raise ConfigError(f"{path}: config file not found") from None
        return parse_config("", source=f"{path} (absent: defaults)", check_params=check_params)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    return parse_config(text, source=path, check_params=check_params)
