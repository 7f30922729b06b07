"""Slurm's topology as slurm-wlm 22.05.8 prints it (tests/fixtures/slurm, recorded on the dev cluster) and the
shared components built on it and on a site file."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuguard.slurm.components import ComponentsError, SWITCH_CHECKS, load_components, parse_components, switch_of
from gpuguard.slurm.topology import parse_topology, read_topology, switches_of

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"


def test_leaf_switches_only_from_real_output():
    topo = parse_topology((FIX / "scontrol_show_topology_22.05_tree.txt").read_text())
    # the spine line lists every node below it (Nodes=node[1-6] Switches=leaf7,leaf8): not what a node hangs from
    assert topo == {"leaf7": ["node1", "node2", "node3", "node4"], "leaf8": ["node5", "node6"]}
    assert switches_of(topo, ["node2", "node6", "node9"]) == {"node2": "leaf7", "node6": "leaf8"}


def test_no_topology_is_no_switch():
    assert parse_topology((FIX / "scontrol_show_topology_22.05_none.txt").read_text()) == {}
    assert read_topology("/bin/false", 2.0, now=1e9) == {}  # scontrol failing: none, never an error


def test_read_topology_runs_scontrol_bounded_and_keeps_it(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho run >> {calls}\ncat {FIX / 'scontrol_show_topology_22.05_tree.txt'}\n")
    fake.chmod(0o755)
    assert read_topology(str(fake), 5.0, now=100.0)["leaf8"] == ["node5", "node6"]
    assert read_topology(str(fake), 5.0, now=130.0)["leaf8"] == ["node5", "node6"]
    assert calls.read_text().count("run") == 1  # kept for the run
    read_topology(str(fake), 5.0, now=200.0)
    assert calls.read_text().count("run") == 2
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    assert read_topology(str(slow), 0.5, now=1.0) == {}  # a hung scontrol: none, within its timeout


SITE = """\
rack:
  nodes:
    rack12: node[01-04]
    rack13: [node05, "node[06-08]"]
pdu:
  checks: [gpu.throttle, gpu.temperature]
  nodes:
    pdu-a3: node[01-08]
"""


def test_site_file_adds_racks_and_pdus(tmp_path):
    parts = parse_components(SITE, "parts.yaml")
    assert [(c.kind, c.name, len(c.nodes), c.checks) for c in parts] == [
        ("rack", "rack12", 4, ()), ("rack", "rack13", 4, ()), ("pdu", "pdu-a3", 8, ("gpu.throttle", "gpu.temperature"))]
    assert parts[0].explains("sys.memory") and not parts[2].explains("fabric.efa")
    site = tmp_path / "parts.yaml"
    site.write_text(SITE)
    cfg = SimpleNamespace(scontrol="/bin/false", conf=None, shared_components_file=str(site))
    both, problems = load_components(cfg, 2.0, topology={"leaf7": ["node01", "node02"]})
    assert problems == [] and [c.label for c in both][:2] == ["switch leaf7", "rack rack12"]
    assert both[0].checks == SWITCH_CHECKS and switch_of(both, "node02") == "leaf7" and switch_of(both, "node05") is None


@pytest.mark.parametrize("text, error", [
    ("rack:\n  nodes:\n    rack12: node[01-\n", "line 3: rack.nodes.rack12: bad hostlist 'node[01-'"),
    ("rack:\n  node:\n    rack12: n1\n", "line 2: rack.node: unknown key (expected nodes, checks)"),
    ("Racks:\n  nodes: {a: n1}\n", "line 1: Racks: a kind is a lower-case name"),
    ("node:\n  nodes: {a: n1}\n", "line 1: node: a kind is a lower-case name"),
    ("pdu:\n  checks: throttle\n  nodes: {a: n1}\n", "line 2: pdu.checks: expected a list of check ids"),
    ("rack:\n  nodes:\n    'rack 12': n1\n", "line 3: rack.nodes.rack 12: a name of letters"),
    ("rack:\n  nodes:\n    r1: 12\n", "line 3: rack.nodes.r1: expected a hostlist"),
    ("rack: [n1]\n", "line 1: rack: expected a mapping with `nodes:`"),
    ("rack:\n  nodes: {r1: [n1\n", "slurm.shared_components_file: parts.yaml: line"),
])
def test_site_file_errors_name_the_key_and_the_line(text, error):
    with pytest.raises(ComponentsError) as e:
        parse_components(text, "parts.yaml")
    assert error in str(e.value) and "slurm.shared_components_file" in str(e.value)


def test_an_unreadable_site_file_is_a_problem_not_an_error(tmp_path):
    cfg = SimpleNamespace(scontrol="/bin/false", conf=None, shared_components_file=str(tmp_path / "missing.yaml"))
    parts, problems = load_components(cfg, 2.0, topology={})
    assert parts == [] and "cannot read" in problems[0] and "slurm.shared_components_file" in problems[0]
