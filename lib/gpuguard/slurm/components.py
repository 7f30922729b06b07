"""Shared components: the parts several nodes hang from, so that one fault of theirs fails a check on all of them at
once (a leaf switch: fabric.efa on the 16 nodes under it; a PDU or a rack: power, throttling, temperature). The
leaf switches come from Slurm's topology (gpuguard.slurm.topology); a site file (`slurm.shared_components_file`)
adds other kinds:

    rack:                           # a kind: a name of letters, digits and _ (it becomes an alert label)
      nodes:
        rack12: node[01-16]         # a component: its nodes, a hostlist (or a list of them)
    pdu:
      checks: [gpu.throttle, gpu.temperature, gpu.nvml]   # what a fault of this kind fails (default: any check)
      nodes:
        pdu-a3: node[01-08]

Parsing and lookups are pure; `load_components` reads the file and the topology (each bounded, never raising: a
broken file is reported and left out, the topology's switches still count). Without either there are no shared
components and nothing changes.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from gpuguard.slurm.hostlist import HostlistError, expand_hostlist
from gpuguard.util.record import Frozen, record

SWITCH = "switch"
# what a leaf switch's fault fails on the nodes under it (a site file's `switch:` kind may name others)
SWITCH_CHECKS = ("fabric.efa", "fabric.ib", "fabric.efa_counters", "nccl.busbw")
KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
NAME_RE = re.compile(r"^[A-Za-z0-9_.@+-]{1,64}$")  # no ':' (a storm mark's separator), no spaces
CHECK_RE = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")
RESERVED_KINDS = ("node", "alertname", "severity", "cluster", "partition", "check", "keyword", "job_id",
                  "component", "component_kind")


class ComponentsError(ValueError):
    """The site file is wrong: the message names the config key, the file, the line and the key path."""


@record
class Component(Frozen):
    kind: str  # switch | rack | pdu | ...
    name: str
    nodes: tuple[str, ...]
    checks: tuple[str, ...] = ()  # the checks its fault fails; () = any check

    def explains(self, check_id: str) -> bool:
        return not self.checks or check_id in self.checks

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name}"


def from_topology(topology: dict[str, list[str]]) -> list[Component]:
    return [Component(SWITCH, name, tuple(nodes), SWITCH_CHECKS) for name, nodes in topology.items()
            if NAME_RE.match(name)]


def components_of(components: list[Component], node: str) -> list[Component]:
    return [c for c in components if node in c.nodes]


def switch_of(components: list[Component], node: str) -> Optional[str]:
    return next((c.name for c in components if c.kind == SWITCH and node in c.nodes), None)


# --------------------------------------------------------------------------- the site file


def _where(source: str, line: Optional[int], path: str) -> str:
    return f"slurm.shared_components_file {source}" + (f": line {line}" if line else "") + f": {path}"


def _hosts(value: Any, where: str) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ComponentsError(f"{where}: expected a hostlist such as node[01-16], got {item!r}")
        try:
            out += expand_hostlist(item.strip())
        except HostlistError as e:
            raise ComponentsError(f"{where}: {e}") from None
    return tuple(dict.fromkeys(out))


def _checks(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(c, str) and CHECK_RE.match(c) for c in value):
        raise ComponentsError(f"{where}: expected a list of check ids such as [gpu.throttle, fabric.efa], "
                              f"got {value!r}")
    return tuple(value)


def _kind(kind: str, body: Any, line: Optional[int], source: str) -> list[Component]:
    from gpuguard.config.yamlutil import Located, strip_located

    if not KIND_RE.match(kind) or kind in RESERVED_KINDS:
        raise ComponentsError(f"{_where(source, line, kind)}: a kind is a lower-case name of letters, digits and _ "
                              f"(not one of {', '.join(RESERVED_KINDS)})")
    if not isinstance(body, Located):
        raise ComponentsError(f"{_where(source, line, kind)}: expected a mapping with `nodes:` (and `checks:`)")
    unknown = sorted(set(body.value) - {"nodes", "checks"})
    if unknown:
        k = unknown[0]
        raise ComponentsError(f"{_where(source, body.lines.get(k), f'{kind}.{k}')}: unknown key (expected nodes, "
                              "checks)")
    nodes = body.value.get("nodes")
    if not isinstance(nodes, Located) or not nodes.value:
        raise ComponentsError(f"{_where(source, body.lines.get('nodes', line), f'{kind}.nodes')}: expected a "
                              "mapping of component name -> hostlist")
    default = SWITCH_CHECKS if kind == SWITCH else ()
    checks = _checks(strip_located(body.value["checks"]), _where(source, body.lines.get("checks"), f"{kind}.checks")) \
        if "checks" in body.value else default
    out = []
    for name, hosts in nodes.value.items():
        where = _where(source, nodes.lines.get(name), f"{kind}.nodes.{name}")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ComponentsError(f"{where}: a name of letters, digits and _.@+- (no spaces, no ':')")
        out.append(Component(kind, name, _hosts(strip_located(hosts), where), checks))
    return out


def parse_components(text: str, source: str) -> list[Component]:
    """The site file's components, or ComponentsError naming the key and line of the first mistake."""
    from gpuguard.config.yamlutil import Located, YamlError, check_yaml_expansion, load_yaml_located

    try:
        check_yaml_expansion(text, source)
        root = load_yaml_located(text, source)
    except YamlError as e:
        raise ComponentsError(f"slurm.shared_components_file: {e}") from None
    if root is None:
        return []
    if not isinstance(root, Located):
        raise ComponentsError(f"{_where(source, 1, '(top)')}: expected a mapping of kind -> {{nodes: ...}}")
    out: list[Component] = []
    for kind, body in root.value.items():
        out += _kind(str(kind), body, root.lines.get(kind), source)
    return out


def load_components(slurm_cfg: Any, timeout_s: float,
                    topology: Optional[dict[str, list[str]]] = None) -> tuple[list[Component], list[str]]:
    """(the leaf switches of Slurm's topology, then the site file's components; what went wrong reading the file).
    Never raises."""
    from gpuguard.slurm.topology import topology_from_config

    topo = topology_from_config(slurm_cfg, timeout_s) if topology is None else topology
    out, problems = from_topology(topo), []
    path = getattr(slurm_cfg, "shared_components_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                out += parse_components(f.read(1 << 22), path)
        except OSError as e:
            problems.append(f"slurm.shared_components_file {path}: cannot read: {e.strerror or e}")
        except ComponentsError as e:
            problems.append(str(e))
    return out, problems
