"""gpuguard.slurm.hostlist (python-hostlist underneath) against Slurm's own `scontrol show hostlistsorted`, plus hostile
and malformed input."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hypothesis import given, settings, strategies as st
from propbudget import examples

from gpuguard.slurm.hostlist import HostlistError, compress_hostlist, expand_hostlist

CASES = [
    ["node003", "node017", "node018", "node019"],
    ["node001", "node002", "node005", "gpu-a"],
    ["n1", "n2", "n3", "n10"],
    ["node9", "node10", "node11"],
    ["rack1-node1", "rack1-node2", "rack2-node1"],
    ["gpu-a10", "gpu-a9", "b", "a"],
    ["x01", "x1"],
    [f"node{i:03d}" for i in range(95, 102)],
    ["p5-st1-1", "p5-st1-2", "p5-st1-4", "p5-st2-1"],
    ["a1b2", "a1b3"],
    ["solo"],
]


@pytest.fixture(scope="module")
def scontrol_hostlist(tmp_path_factory):
    """`scontrol show hostlistsorted` needs a slurm.conf to start, but no daemon."""
    scontrol = shutil.which("scontrol")
    if not scontrol:
        pytest.skip("scontrol (slurm-wlm) not installed")
    conf = tmp_path_factory.mktemp("slurmconf") / "slurm.conf"
    conf.write_text("ClusterName=hostlisttest\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\n"
                    "PartitionName=p Nodes=n1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}

    def run(names: list[str]) -> str:
        p = subprocess.run([scontrol, "show", "hostlistsorted", ",".join(names)], env=env, capture_output=True,
                           text=True, timeout=10)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    return run


@pytest.mark.parametrize("names", CASES, ids=lambda c: ",".join(c)[:40])
def test_compression_matches_slurm(names, scontrol_hostlist):
    assert compress_hostlist(names) == scontrol_hostlist(names)


@pytest.mark.parametrize("names", CASES, ids=lambda c: ",".join(c)[:40])
def test_expansion_round_trips_through_slurm_notation(names, scontrol_hostlist):
    assert sorted(expand_hostlist(scontrol_hostlist(names))) == sorted(names)


def test_status_example():
    assert compress_hostlist(["node019", "node003", "node018", "node017", "node003"]) == "node[003,017-019]"
    assert compress_hostlist([]) == ""


def test_expand():
    assert expand_hostlist("node[1-3,5],gpu-a[08-10]") == ["node1", "node2", "node3", "node5", "gpu-a08", "gpu-a09",
                                                           "gpu-a10"]
    assert expand_hostlist(" node1 , node2 ,node1") == ["node1", "node2"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("") == []


@pytest.mark.parametrize("bad", ["node[1-", "node[3-1]", "no de1", "node;rm", "n$(id)", "node[1-9999999]",
                                 "x[a-b]", "n[[1]]", "`reboot`"])
def test_bad_hostlists_are_a_clear_error(bad):
    with pytest.raises(HostlistError):
        expand_hostlist(bad)


def test_a_name_that_cannot_be_in_a_hostlist():
    with pytest.raises(HostlistError):
        compress_hostlist(["node1", "node[2]"])


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["node", "gpu-a", "r1-n", "x"]), st.integers(0, 2000),
                          st.sampled_from([0, 3, 4])), max_size=40))
def test_compress_then_expand_is_the_set_of_names(parts):
    names = [f"{p}{n:0{w}d}" if w else f"{p}{n}" for p, n, w in parts]
    assert sorted(expand_hostlist(compress_hostlist(names))) == sorted(set(names))
