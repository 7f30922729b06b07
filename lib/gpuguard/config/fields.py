"""What a config section is made of: `key(validator, default)` fields on a `@section` dataclass, and the validators.

Each feature declares its own section beside its code (`gpuguard/watch/config.py` holds `WatchConfig`, ...); each
key is one field whose validator and default are declared together, with a comment saying what it means.
`gpuguard.config.schema` is the one place that loads a file against them (errors name file, line and key) and
assembles the typed `Config`. A feature module imports only this one, so the hooks can load every section cheaply.

A validator takes the YAML value and returns it (normalised) or raises ValueError with the message the admin sees
after "line N: section.key: ".
"""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import MISSING, Field, FrozenInstanceError, dataclass, field
from typing import Any, Callable, Mapping, Optional, TypeVar, dataclass_transform

Validator = Callable[[Any], Any]  # returns the normalised value or raises ValueError(msg)

T = TypeVar("T")
R = TypeVar("R", bound="Record")


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


def validator_of(f: Field) -> Validator:  # type: ignore[type-arg]
    return f.metadata["validate"]  # type: ignore[no-any-return]


def key_names(cls: type) -> tuple[str, ...]:
    """The fields of a `@record` class in declaration order, without running the dataclass machinery."""
    return tuple(name for name, _, _ in cls._defaults)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- records: cheap dataclasses
#
# Every hook that runs in its own process imports every section before its job starts. `@dataclass` costs about
# 40,000 instructions per field (some 8 million for the ~200 keys, measured with valgrind), so a `@record` class
# becomes a dataclass (`dataclasses.fields`, `replace`, `asdict`, `is_dataclass`) the first time something asks
# for that, and `__init__`, `__repr__`, `__eq__` are written once in Record instead of generated per class.

_DATACLASS_ATTRS = frozenset({"__dataclass_fields__", "__dataclass_params__", "__match_args__"})
_PENDING = "_dataclass_pending"
_processing = threading.Lock()


class _RecordType(type):
    def __getattr__(cls, name: str) -> Any:  # only for attributes the class does not have (yet)
        if name in _DATACLASS_ATTRS and cls.__dict__.get(_PENDING):
            with _processing:
                if cls.__dict__.get(_PENDING):
                    dataclass(init=False, repr=False, eq=False)(cls)  # type: ignore[arg-type]
                    type.__setattr__(cls, _PENDING, False)
            return type.__getattribute__(cls, name)
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")


class Record(metaclass=_RecordType):
    """The base of gpuguard's config dataclasses (`@record`): arguments in field order or by name, as a dataclass
    takes them; a missing one takes its default."""

    __slots__ = ()
    _defaults: tuple[tuple[str, Any, Optional[Callable[[], Any]]], ...] = ()

    def __init__(self, *args: Any, **values: Any) -> None:
        if args:
            if len(args) > len(self._defaults):
                raise TypeError(f"{type(self).__name__}: {len(args)} positional arguments for "
                                f"{len(self._defaults)} fields")
            for (name, _, _), value in zip(self._defaults, args):
                if name in values:
                    raise TypeError(f"{type(self).__name__}: {name} given twice")
                values[name] = value
        d = self.__dict__  # not setattr: a frozen record refuses it, and this is every hook's path
        given = 0
        for name, default, factory in self._defaults:
            if name in values:
                d[name] = values[name]
                given += 1
            elif factory is not None:
                d[name] = factory()
            elif default is MISSING:
                raise TypeError(f"{type(self).__name__}: missing {name}")
            else:
                d[name] = default
        if given != len(values):
            unknown = sorted(set(values) - set(key_names(type(self))))
            raise TypeError(f"{type(self).__name__}: unknown key(s) {', '.join(unknown)}")

    @classmethod
    def from_trusted(cls: type[R], values: Mapping[str, Any]) -> R:
        """An instance from values validated earlier (the compiled configuration): unknown keys are dropped,
        missing ones take their defaults."""
        self = cls.__new__(cls)
        d = self.__dict__
        for name, default, factory in cls._defaults:
            if name in values:
                d[name] = values[name]
            else:
                d[name] = factory() if factory is not None else default
        return self

    def __getattr__(self, name: str) -> Any:  # only for attributes the instance does not have
        if name in _DATACLASS_ATTRS:
            return getattr(type(self), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n, _, _ in self._defaults)})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n, _, _ in self._defaults)


class Frozen(Record):
    """A frozen record: assigning an attribute raises FrozenInstanceError (change a copy with
    `dataclasses.replace`)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n, _, _ in self._defaults))  # a list or mapping value: TypeError

    def as_mapping(self) -> dict[str, Any]:
        """key -> value (a copy), for display and the compiled last good configuration."""
        return {n: copy.deepcopy(getattr(self, n)) for n, _, _ in self._defaults}


@dataclass_transform(field_specifiers=(field, key))
def record(cls: type[T]) -> type[T]:
    """Make `cls` (a subclass of Record) a dataclass of its own annotated fields (`key(...)`, `field(...)` or a
    plain default), in declaration order; ClassVar annotations are not fields, and fields are not inherited."""
    found = []
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if str(annotation).startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = cls.__dict__.get(name, MISSING)
        if isinstance(value, Field):
            found.append((name, value.default, None if value.default_factory is MISSING else value.default_factory))
        else:
            found.append((name, value, None))
    type.__setattr__(cls, "_defaults", tuple(found))
    type.__setattr__(cls, _PENDING, True)
    return cls


class Section(Frozen):
    """The base of every config section (one per YAML section, beside its feature)."""

    __slots__ = ()


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
