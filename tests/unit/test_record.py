"""gpuguard.util.record: the hooks' plain data behaves as the dataclasses it replaces (construction, equality,
hashing, frozenness, replace, asdict), and becomes a real dataclass only when something asks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any, Optional

import pytest

from gpuguard.model import Finding, GpuInfo, GpuProcess, NvmlObservation, PendingDrain, Severity, XidEvent
from gpuguard.util.record import Frozen, Record, as_dict, field, field_names, record, replace


@record
class _Point(Frozen):
    x: int
    y: int = 0
    tags: list[str] = field(default_factory=list)


def test_arguments_in_field_order_or_by_name_defaults_and_factories():
    a, b = _Point(1), _Point(1, tags=["t"])
    assert (a.x, a.y, a.tags, b.tags) == (1, 0, [], ["t"]) and a.tags is not _Point(1).tags
    assert _Point(1, 2) == _Point(x=1, y=2) != _Point(1, 3)
    assert repr(_Point(1, 2)) == "_Point(x=1, y=2, tags=[])"
    for bad in (lambda: _Point(), lambda: _Point(1, z=2), lambda: _Point(1, x=1), lambda: _Point(1, 2, [], 4)):
        with pytest.raises(TypeError):
            bad()


def test_frozen_refuses_assignment_and_hashes_by_value_a_mutable_one_does_not_hash():
    p = XidEvent(79, "0000:3b:00", "fallen off the bus")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.code = 48  # type: ignore[misc]
    assert hash(p) == hash(XidEvent(79, "0000:3b:00", "fallen off the bus"))
    with pytest.raises(TypeError):
        hash(GpuProcess(1))


def test_replace_and_as_dict_match_the_dataclass_functions():
    f = Finding("gpu.ecc", Severity.FAIL, "2 DBE", evidence={"counts": [2, {"gpu": 5}]}, gpu=5)
    g = replace(f, message="3 DBE")
    assert g.message == "3 DBE" and f.message == "2 DBE" and g.evidence is f.evidence  # a shallow copy, as theirs
    with pytest.raises(TypeError):
        replace(f, nope=1)
    obs = NvmlObservation(driver_version="550.90.07", gpus=[GpuInfo(0, processes=[GpuProcess(7, 10)])])
    mine = as_dict(obs)
    assert mine == dataclasses.asdict(obs) and mine["gpus"][0]["processes"] == [
        {"pid": 7, "used_memory_mib": 10, "name": None}]
    d = as_dict(f)
    d["evidence"]["counts"][1]["gpu"] = 6  # a deep copy, as asdict's
    assert f.evidence["counts"][1]["gpu"] == 5
    assert dataclasses.replace(f, gpu=None) == replace(f, gpu=None)


def test_the_dataclass_machinery_runs_once_something_asks():
    @record
    class Late(Record):
        a: int
        b: Optional[str] = None
        c: dict[str, Any] = field(default_factory=dict, metadata={"doc": "c"})

    assert "__dataclass_fields__" not in Late.__dict__
    assert dataclasses.is_dataclass(Late(1)) and [f.name for f in dataclasses.fields(Late)] == ["a", "b", "c"]
    assert dataclasses.fields(Late)[2].metadata["doc"] == "c" and Late(1).c == {} and Late.b is None
    assert field_names(PendingDrain)[:3] == ("id", "op", "reason")
    pd = PendingDrain("x", "drain", "r", "drain", None, 1.0, "prolog")
    assert PendingDrain.from_dict({**pd.to_dict(), "unknown": 1}) == pd


def test_a_hook_never_imports_the_dataclass_machinery():
    code = ("import sys; from gpuguard.model import Finding, Severity; from gpuguard.util.record import replace, "
            "as_dict; f = replace(Finding('a', Severity.OK, 'm'), gpu=1); as_dict(f); f == f; repr(f); "
            "print('dataclasses' in sys.modules)")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_record_does_what_a_dataclass_does_or_refuses_what_a_dataclass_refuses():
    """Issue 30: records silently differed from dataclasses (no inherited fields, a shared mutable default,
    `__post_init__` never run). Each case here is checked against a real dataclass of the same shape."""

    @record
    class Base(Record):
        a: int
        b: int = 2

    @record
    class Child(Base):
        c: int = 3
        b: int = 20  # redefined: keeps its place, takes the new default

    @dataclasses.dataclass
    class DBase:
        a: int
        b: int = 2

    @dataclasses.dataclass
    class DChild(DBase):
        c: int = 3
        b: int = 20

    assert field_names(Child) == tuple(f.name for f in dataclasses.fields(DChild)) == ("a", "b", "c")
    assert as_dict(Child(1)) == dataclasses.asdict(DChild(1)) == {"a": 1, "b": 20, "c": 3}
    assert Child(1, 5, 6).b == DChild(1, 5, 6).b == 5

    for shape in ({"tags": []}, {"seen": {}}, {"ids": set()}):
        name, value = next(iter(shape.items()))
        with pytest.raises(ValueError, match="mutable default"):
            record(type("Bad", (Record,), {"__annotations__": {name: "list"}, name: value}))
        with pytest.raises(ValueError):
            dataclasses.dataclass(type("DBad", (), {"__annotations__": {name: "list"}, name: value}))
    with pytest.raises(TypeError, match="without a default follows"):
        record(type("Order", (Record,), {"__annotations__": {"x": "int", "y": "int"}, "x": 1}))
    with pytest.raises(TypeError):
        dataclasses.dataclass(type("DOrder", (), {"__annotations__": {"x": "int", "y": "int"}, "x": 1}))

    @record
    class Checked(Record):
        port: int

        def __post_init__(self) -> None:
            if not 0 < self.port < 65536:
                raise ValueError(f"port {self.port} out of range")

    assert Checked(80).port == 80
    with pytest.raises(ValueError, match="out of range"):
        Checked(0)
