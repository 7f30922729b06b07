"""YAML loading with line numbers, so a bad config can name the key *and* the line; JSON loading with the same
promise: bad input is a clear error (YamlError / NestingError, both ValueErrors), never a traceback.

Nesting is bounded (MAX_DEPTH levels): no config, scenario, job file or tool output comes near it, and input nested
deeper (100000 `[`) would otherwise end in a RecursionError deep inside the parser or in `_construct`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import yaml

try:  # libyaml is ~10x faster; the prolog loads config on every job
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader


MAX_DEPTH = 100


class YamlError(ValueError):
    """A YAML file could not be read or parsed. The message names the file and line."""


class NestingError(YamlError):
    """The input is nested deeper than MAX_DEPTH (or than Python can follow)."""


def _too_deep(source: str) -> NestingError:
    return NestingError(f"{source}: nested too deeply to read (deeper than Python can follow)")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_depth(root: yaml.Node, limit: int = MAX_DEPTH) -> None:
    """Raise NestingError when the composed node graph is deeper than `limit`, YamlError when an alias makes it
    recursive (messages name the line; the caller adds the source). Iterative, and each node (aliases share
    them) is measured once, so it is linear in the document."""
    height: dict[int, int] = {}  # finished nodes: levels below and including them
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, Any]] = [(root, iter(_children(root)))]
    on_path.add(id(root))
    while stack:
        node, kids = stack[-1]
        child = next(kids, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            height[id(node)] = 1 + max((height[id(c)] for c in _children(node)), default=0)
            continue
        if id(child) in on_path:
            raise YamlError(f"line {child.start_mark.line + 1}: a recursive alias (the node contains itself)")
        if id(child) in height:
            if len(stack) + height[id(child)] > limit:
                raise NestingError(f"line {child.start_mark.line + 1}: nested deeper than {limit} levels")
            continue
        if len(stack) + 1 > limit:
            raise NestingError(f"line {child.start_mark.line + 1}: nested deeper than {limit} levels")
        on_path.add(id(child))
        stack.append((child, iter(_children(child))))


def load_json(text: Union[str, bytes], source: str = "<string>") -> Any:
    """json.loads for input from files and tools; input nested too deeply is a NestingError naming the source,
    not a RecursionError. Other bad JSON raises json.JSONDecodeError (a ValueError) as usual."""
    import json

    try:
        return json.loads(text)
    except RecursionError:
        raise _too_deep(source) from None


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
    return _load(text, source, _construct, column=True)


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
    return load_yaml_text(text, str(p))


def load_yaml_text(text: Union[str, bytes], source: str = "<string>") -> Any:
    """Plain data from YAML text (no line info); errors name `source` and the line."""
    return _load(text, source, lambda node, loader: loader.construct_document(node), column=False)


def _load(text: Union[str, bytes], source: str, construct: Any, column: bool) -> Any:
    """One document through `construct(node, loader)`, None when empty; every parse error a YamlError naming
    `source` and the line (and the column)."""
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            check_depth(node)
            return construct(node, loader)
        finally:
            loader.dispose()
    except RecursionError:  # the pure-Python parser (no libyaml) recurses while composing
        raise _too_deep(source) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = (f"line {mark.line + 1}" + (f", column {mark.column + 1}" if column else "")) if mark \
            else "unknown line"
        raise YamlError(f"{source}: {where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise YamlError(f"{source}: {e}") from None
    except YamlError as e:
        raise type(e)(f"{source}: {e}") from None


MAX_YAML_NODES = 100_000  # a real config has a few hundred; "billion laughs" aliases expand to billions


def check_yaml_expansion(text: str, source: str, limit: int = MAX_YAML_NODES) -> None:
    """Refuse YAML whose aliases expand to more than `limit` nodes (a "billion laughs" document is a few hundred
    bytes, expands exponentially and would hang the prolog). Counted on the composed node graph, where an alias
    is the same node object again: linear in the document, iterative (no recursion limit)."""
    if "*" not in text:  # no alias, nothing can expand: skip the second compose on the prolog's path
        return
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError:
        return  # the real parse reports the error with its line
    if root is None:
        return
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        kids = _children(node)
        if children_done or not kids:
            total = 1 + sum(size.get(id(k), 0) for k in kids)
            if total > limit:
                line = node.start_mark.line + 1
                raise YamlError(f"{source}: line {line}: document expands to more than {limit} nodes through "
                                f"aliases (&anchor/*alias): refused")
            size[id(node)] = total
            continue
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
