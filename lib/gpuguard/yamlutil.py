"""YAML loading with line numbers, so a bad config can name the key *and* the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import yaml

try:  # libyaml is ~10x faster; the prolog loads config on every job
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader


class YamlError(ValueError):
    """A YAML file could not be read or parsed. The message names the file and line."""


class Located:
    """A parsed mapping plus the line of each key (1-based), for error messages."""

    __slots__ = ("value", "lines", "line")

    def __init__(self, value: Any, lines: dict[str, int], line: int) -> None:
        self.value = value
        self.lines = lines
        self.line = line


def _construct(node: yaml.Node, loader: Any) -> Any:
    """Build plain Python data; mappings become `Located` so lines survive."""
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):
                raise YamlError(f"line {key_node.start_mark.line + 1}: a key must be a scalar")
            if key in out:
                raise YamlError(f"line {key_node.start_mark.line + 1}: duplicate key '{key}'")
            out[key] = _construct(value_node, loader)
            lines[str(key)] = key_node.start_mark.line + 1
        return Located(out, lines, node.start_mark.line + 1)
    if isinstance(node, yaml.SequenceNode):
        return [_construct(n, loader) for n in node.value]
    return loader.construct_object(node, deep=True)


def load_yaml_located(text: Union[str, bytes], source: str = "<string>") -> Any:
    """Parse YAML keeping key line numbers. Returns None for an empty document."""
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            return _construct(node, loader)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        raise YamlError(f"{source}: {where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise YamlError(f"{source}: {e}") from None
    except YamlError as e:
        raise YamlError(f"{source}: {e}") from None


def strip_located(value: Any) -> Any:
    if isinstance(value, Located):
        return {k: strip_located(v) for k, v in value.value.items()}
    if isinstance(value, list):
        return [strip_located(v) for v in value]
    return value


def load_yaml_file(path: Union[str, Path]) -> Any:
    """Plain data from a YAML file (no line info)."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise YamlError(f"{p}: cannot read: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}" if mark else "unknown line"
        raise YamlError(f"{p}: {where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise YamlError(f"{p}: {e}") from None
