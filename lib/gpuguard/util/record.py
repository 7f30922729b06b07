"""Records: dataclasses that cost nothing to define.

Every hook that runs in its own process imports the pipeline's plain data (gpuguard.model, the run context, the
checks' inputs, the config sections) before its job starts. `@dataclass` generates and compiles `__init__`,
`__repr__` and `__eq__` for every class when it is defined (about 40,000 instructions per field, measured with
valgrind), and importing `dataclasses` pulls in `inspect` and `ast`: together some 45 ms of every hook's start.

A `@record` class is a dataclass the first time something asks for it (`dataclasses.fields`, `asdict`, `replace`,
`is_dataclass`: they import `dataclasses` themselves); until then `__init__`, `__repr__`, `__eq__` (and, for
`Frozen`, `__hash__` and refusing assignment) are written once here, in `Record`, instead of per class.
`replace` and `as_dict` below do what `dataclasses.replace` / `asdict` do for records without importing
anything.

    @record
    class Finding(Record):
        check_id: str
        evidence: dict[str, Any] = field(default_factory=dict)

Fields are a base record's fields, then the class's own annotations in declaration order (ClassVar ones excepted),
as with `@dataclass`; a mutable plain default and a field without a default after one with a default are refused as
`@dataclass` refuses them, and `__post_init__` runs after `__init__`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Optional, TypeVar

try:
    from typing import dataclass_transform
except ImportError:  # Python 3.9/3.10 (Ubuntu 22.04, DGX OS 6): only type checkers read it
    def dataclass_transform(**_: Any) -> Callable[[T], T]:  # type: ignore[no-redef]
        return lambda f: f

T = TypeVar("T")
R = TypeVar("R", bound="Record")


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # no default: the field must be given


class FieldSpec:
    """A field's default (or default factory) and metadata, as `dataclasses.field` takes them."""

    __slots__ = ("default", "default_factory", "metadata")

    def __init__(self, default: Any, default_factory: Optional[Callable[[], Any]],
                 metadata: Optional[Mapping[str, Any]]) -> None:
        self.default, self.default_factory, self.metadata = default, default_factory, metadata


def field(*, default: Any = MISSING, default_factory: Optional[Callable[[], Any]] = None,
          metadata: Optional[Mapping[str, Any]] = None) -> Any:
    """A record field with a default, or a factory for each instance's own default (a list, a dict)."""
    return FieldSpec(default, default_factory, metadata)


_DATACLASS_ATTRS = frozenset({"__dataclass_fields__", "__dataclass_params__", "__match_args__"})
_PENDING = "_dataclass_pending"
_processing = threading.Lock()


def _become_dataclass(cls: type) -> None:
    import dataclasses  # only when something asks for the dataclass machinery

    for name, default, factory, metadata in cls._fields:  # type: ignore[attr-defined]
        type.__setattr__(cls, name, dataclasses.field(
            **({"default_factory": factory} if factory is not None else {"default": default}),
            metadata=metadata))
    dataclasses.dataclass(init=False, repr=False, eq=False)(cls)
    for name, default, factory, _ in cls._fields:  # type: ignore[attr-defined]
        if factory is None and default is not MISSING:
            type.__setattr__(cls, name, default)


class _RecordType(type):
    def __getattr__(cls, name: str) -> Any:  # only for attributes the class does not have (yet)
        if name in _DATACLASS_ATTRS and cls.__dict__.get(_PENDING):
            with _processing:
                if cls.__dict__.get(_PENDING):
                    _become_dataclass(cls)
                    type.__setattr__(cls, _PENDING, False)
            return type.__getattribute__(cls, name)
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")


class Record(metaclass=_RecordType):
    """The base of a `@record` class: arguments in field order or by name, as a dataclass takes them; a missing one
    takes its default."""

    __slots__ = ()
    _fields: tuple[tuple[str, Any, Optional[Callable[[], Any]], Optional[Mapping[str, Any]]], ...] = ()

    def __init__(self, *args: Any, **values: Any) -> None:
        if args:
            if len(args) > len(self._fields):
                raise TypeError(f"{type(self).__name__}: {len(args)} positional arguments for "
                                f"{len(self._fields)} fields")
            for spec, value in zip(self._fields, args):
                if spec[0] in values:
                    raise TypeError(f"{type(self).__name__}: {spec[0]} given twice")
                values[spec[0]] = value
        d = self.__dict__  # not setattr: a frozen record refuses it
        given = 0
        for name, default, factory, _ in self._fields:
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
            unknown = sorted(set(values) - set(field_names(type(self))))
            raise TypeError(f"{type(self).__name__}: unknown field(s) {', '.join(unknown)}")
        post = getattr(type(self), "__post_init__", None)
        if post is not None:
            post(self)

    @classmethod
    def from_trusted(cls: type[R], values: Mapping[str, Any]) -> R:
        """An instance from values validated earlier (a compiled copy): unknown keys are dropped, missing ones take
        their defaults."""
        self = cls.__new__(cls)
        d = self.__dict__
        for name, default, factory, _ in cls._fields:
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
        return f"{type(self).__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n, *_ in self._fields)})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n, *_ in self._fields)


class Frozen(Record):
    """A frozen record: assigning an attribute raises dataclasses.FrozenInstanceError (change a copy with
    `replace`)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        from dataclasses import FrozenInstanceError  # the error path only

        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        from dataclasses import FrozenInstanceError  # the error path only

        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n, *_ in self._fields))  # a list or mapping value: TypeError


@dataclass_transform(field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """Make `cls` (a subclass of Record or Frozen) a dataclass of its annotated fields (`field(...)` or a plain
    default): a base record's fields first, then its own in declaration order (a redefined one keeps its place), as
    `@dataclass` orders them. What a dataclass refuses is refused here too: a mutable (unhashable) plain default
    (ValueError: use field(default_factory=...)) and a field without a default after one with a default
    (TypeError). `__post_init__`, when defined, runs after `__init__`."""
    specs: dict[str, tuple[str, Any, Optional[Callable[[], Any]], Optional[Mapping[str, Any]]]] = {}
    for base in reversed(cls.__mro__[1:]):
        for spec in base.__dict__.get("_fields", ()):
            specs[spec[0]] = spec
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if str(annotation).startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = cls.__dict__.get(name, MISSING)
        if isinstance(value, FieldSpec):
            specs[name] = (name, value.default, value.default_factory, value.metadata)
            value = value.default
        else:
            specs[name] = (name, value, None, None)
        if value is not MISSING and type(value).__hash__ is None:
            raise ValueError(f"{cls.__name__}.{name}: mutable default {type(value).__name__} is not allowed: use "
                             "field(default_factory=...)")
    defaulted = None
    for name, default, factory, _ in specs.values():
        if default is MISSING and factory is None and defaulted is not None:
            raise TypeError(f"{cls.__name__}: field {name} without a default follows {defaulted}, which has one")
        if default is not MISSING or factory is not None:
            defaulted = name
    type.__setattr__(cls, "_fields", tuple(specs.values()))
    type.__setattr__(cls, _PENDING, True)
    return cls


def field_names(cls: type) -> tuple[str, ...]:
    """The fields of a `@record` class in declaration order, without the dataclass machinery."""
    return tuple(spec[0] for spec in cls._fields)  # type: ignore[attr-defined]


def replace(obj: T, **changes: Any) -> T:
    """`dataclasses.replace` for a record (a dataclass goes to dataclasses.replace): a copy with `changes`."""
    cls = type(obj)
    if not isinstance(obj, Record):
        import dataclasses

        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    unknown = set(changes) - set(field_names(cls))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown field(s) {', '.join(sorted(unknown))}")
    new = cls.__new__(cls)
    new.__dict__.update({n: getattr(obj, n) for n, *_ in cls._fields})  # type: ignore[attr-defined]
    new.__dict__.update(changes)
    return new


def as_dict(obj: Any) -> Any:
    """`dataclasses.asdict` for records: nested records, lists, tuples and dicts converted, anything else deep-copied."""
    if isinstance(obj, Record):
        return {n: as_dict(getattr(obj, n)) for n, *_ in obj._fields}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(as_dict(v) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((as_dict(k), as_dict(v)) for k, v in obj.items())
    if hasattr(type(obj), "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(obj)
    import copy  # only for a value that is neither a record nor a container (copy imports weakref)

    return copy.deepcopy(obj)
