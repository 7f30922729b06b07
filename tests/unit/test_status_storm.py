"""`gpuguard status`'s view of the drain-storm guard (gpuguard.cli.status_held) against a stub scontrol printing a
recorded `show node -o` and `show topology`: a node the partition rule held before its switch was blamed is shown
under that switch's fault, as the storm guard itself counts it (gpuguard.pipeline.storm), not as a separate storm."""

from __future__ import annotations

import json
import time

import yaml
from clirun import gpuguard

from gpuguard.pipeline.storm import format_mark

NOW = time.time()


def node_line(name: str, comment: str) -> str:
    return (f"NodeName={name} Arch=x86_64 CoresPerSocket=1 State=IDLE ThreadsPerCore=1 Partitions=gpu "
            f"Comment={comment or '(null)'} Reason=(null)")


def status(tmp_path, marks: dict[str, str], *args: str) -> str:
    (tmp_path / "nodes.txt").write_text("\n".join(node_line(f"n{i:03d}", marks.get(f"n{i:03d}", ""))
                                                  for i in range(1, 9)) + "\n")
    (tmp_path / "topo.txt").write_text("SwitchName=leaf4 Level=0 LinkSpeed=1 Nodes=n[001-004]\n"
                                       "SwitchName=leaf5 Level=0 LinkSpeed=1 Nodes=n[005-008]\n")
    stub = tmp_path / "scontrol"
    stub.write_text(f'#!/bin/sh\ncase "$*" in *topology*) cat {tmp_path / "topo.txt"};; '
                    f'*) cat {tmp_path / "nodes.txt"};; esac\n')
    stub.chmod(0o755)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"slurm": {"scontrol": str(stub)}, "logging": {"syslog": False},
                                   "store": {"path": str(tmp_path / "state" / "{node}.db")}}))
    p = gpuguard("status", "--config", str(cfg), *args)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_a_node_the_partition_rule_held_before_its_switch_was_blamed_shows_under_the_switch(tmp_path):
    """n001 was held by the partition rule (its mark names no component); then n002 and n003 failed too and leaf4 was
    blamed (their marks name it). One switch fault of 3 nodes, not a drain storm of 1 beside it."""
    marks = {"n001": format_mark("held", "fabric.efa", NOW - 200),
             "n002": format_mark("held", "fabric.efa", NOW - 10, "switch=leaf4"),
             "n003": format_mark("held", "fabric.efa", NOW - 9, "switch=leaf4"),
             "n006": format_mark("held", "sys.memory", NOW - 50)}  # a storm of its own elsewhere
    out = status(tmp_path, marks)
    assert "held by the drain-storm guard (failing, not drained): 4 node(s)" in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("  fabric.efa") or ln.startswith("  sys.memory")]
    assert len(lines) == 2, out
    efa, mem = sorted(lines)
    assert efa.split()[1:3] == ["3", "n[001-003]"] and "one switch fault: switch leaf4" in efa, out
    assert "(n001 held by the partition rule before it was blamed)" in efa, out
    assert mem.split()[1:3] == ["1", "n006"] and "drain storm (one cause on many nodes)" in mem, out
    held = {h["node"]: h for h in json.loads(status(tmp_path, marks, "--json"))["held"]}
    assert {n: h["component"] for n, h in held.items()} == {"n001": "switch=leaf4", "n002": "switch=leaf4",
                                                            "n003": "switch=leaf4", "n006": ""}
    assert held["n001"].get("before_blame") is True and "before_blame" not in held["n002"]


def test_a_partition_held_node_under_a_switch_nobody_is_held_for_stays_a_drain_storm(tmp_path):
    marks = {"n001": format_mark("held", "fabric.efa", NOW - 200),
             "n005": format_mark("held", "fabric.efa", NOW - 10, "switch=leaf5")}  # another switch
    out = status(tmp_path, marks)
    assert any(ln.startswith("  fabric.efa") and "n001" in ln and "drain storm" in ln for ln in out.splitlines()), out
