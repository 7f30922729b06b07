"""What a config section is made of: `key(validator, default)` fields on a `@section` dataclass, and the validators.

Each feature's section is a module of gpuguard/config/sections/ (`sections/watch.py` holds `WatchConfig`, ...); each
key is one field whose validator and default are declared together, with a comment saying what it means.
`gpuguard.config.schema` is the one place that loads a file against them (errors name file, line and key) and
assembles the typed `Config`. A section module imports only this one, so the hooks can load every section
cheaply; the config package imports no feature (the layers: ARCHITECTURE.md).

A validator takes the YAML value and returns it (normalised) or raises ValueError with the message the admin sees
after "line N: section.key: ".
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional

from gpuguard.util.record import Frozen, field, field_names, record

Validator = Callable[[Any], Any]  # returns the normalised value or raises ValueError(msg)


def key(validator: Validator, default: Any = None, default_factory: Optional[Callable[[], Any]] = None) -> Any:
    """A config key: its validator and its default, declared on the section's field. A list or mapping default is
    copied for each instance (no config shares a mutable default with another); `default_factory`: a default that
    depends on the node (read when a config is built)."""
    meta = {"validate": validator}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def validator_of(f: Any) -> Validator:
    """The validator of a section's field (a `dataclasses.Field` of the section, once it is a dataclass)."""
    return f.metadata["validate"]  # type: ignore[no-any-return]


class Section(Frozen):
    """The base of every config section (one per YAML section)."""

    __slots__ = ()

    def as_mapping(self) -> dict[str, Any]:
        """key -> value (a copy), for display and the compiled last good configuration."""
        return {n: copy.deepcopy(getattr(self, n)) for n in field_names(type(self))}


section = record  # a config section: `@section class WatchConfig(Section)` with `key(...)` fields


# --------------------------------------------------------------------------- validators


def number(minimum: float = 0.0, strict: bool = True, allow_none: bool = False) -> Validator:
    def v(x: Any) -> Any:
        if x is None and allow_none:
            return None
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"expected a number{' or null' if allow_none else ''}, got {x!r}")
        if not math.isfinite(x):  # YAML's .nan / .inf: a deadline of infinity is no deadline at all
            raise ValueError(f"expected a finite number, got {x!r}")
        if (x <= minimum) if strict else (x < minimum):
            raise ValueError(f"expected a number {'>' if strict else '>='} {minimum:g}, got {x!r}")
        return x

    return v


def integer(minimum: int = 0, allow_none: bool = False) -> Validator:
    def v(x: Any) -> Any:
        if x is None and allow_none:
            return None
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"expected an integer{' or null' if allow_none else ''}, got {x!r}")
        if x < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {x!r}")
        return x

    return v


def boolean(x: Any) -> Any:
    if not isinstance(x, bool):
        raise ValueError(f"expected true or false, got {x!r}")
    return x


def string(allow_none: bool = False) -> Validator:
    def v(x: Any) -> Any:
        if x is None and allow_none:
            return None
        if not isinstance(x, str) or not x:
            raise ValueError(f"expected a non-empty string{' or null' if allow_none else ''}, got {x!r}")
        return x

    return v


def choice(*choices: str) -> Validator:
    def v(x: Any) -> Any:
        if x not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {x!r}")
        return x

    return v


def str_list(x: Any) -> Any:
    if not isinstance(x, list) or not all(isinstance(i, str) and i for i in x):
        raise ValueError(f"expected a list of strings, got {x!r}")
    return list(x)


def int_list(x: Any) -> Any:
    if not isinstance(x, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        raise ValueError(f"expected a list of integers, got {x!r}")
    return list(x)


def mapping(x: Any) -> Any:
    if not isinstance(x, dict):
        raise ValueError(f"expected a mapping, got {x!r}")
    return x


def secret_list(x: Any) -> Any:
    """A list of strings that may carry tokens (apprise URLs): an error never quotes them."""
    if not isinstance(x, list) or not all(isinstance(i, str) and i for i in x):
        raise ValueError(f"expected a list of non-empty URL strings, got a {type(x).__name__} (value not shown: "
                         "it may hold tokens)")
    return list(x)
