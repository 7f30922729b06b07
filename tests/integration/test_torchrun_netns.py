"""The torchrun template on nodes that are really apart (devtools.devnetns.NodeNetworks): each node's slurmd, and so
each torchrun and worker, in its own network namespace with its own address on a bridge, its own host name, and
Debian's /etc/hosts mapping that name to 127.0.1.1. A job that tells its peers a loopback address fails here as on
a real cluster, where on the default dev cluster (one network namespace) it would work."""

from __future__ import annotations

import re
import subprocess

import pytest
from torchjob import NEEDS_HOST_VIEW, NEEDS_TORCH, Job, netns_site

pytestmark = [NEEDS_HOST_VIEW]


@NEEDS_TORCH
@pytest.mark.slow(75)
def test_a_two_node_gloo_job_trains_on_debian_nodes(site_factory):
    """Issue 29 item 1: gloo finds the address it announces to its peers by resolving the host name, which stock
    Debian/Ubuntu /etc/hosts maps to 127.0.1.1: every worker died in init_process_group("gloo") with "Gloo
    connectFullMesh failed ... remote=[127.0.1.1]". The template now points gloo (GLOO_SOCKET_IFNAME) and NCCL's
    bootstrap (NCCL_SOCKET_IFNAME) at the interface that carries the node's own address."""
    site = netns_site(site_factory, nodes=2)
    view = site.cluster.host_view
    job = Job(site, steps=4, step_time=0.2, max_failures=0)
    info = job.wait(timeout=240)
    out = job.output()
    assert "127.0.1.1" not in out, job.why(info)
    assert info["JobState"] == "COMPLETED", job.why(info)
    for index, node in enumerate(("node1", "node2")):
        assert re.search(rf"^{index}: \[rank(\d)\]: rank \1/2 on {node}:", out, re.M), out[-4000:]
    assert f"rendezvous {view.node_addr(1)}:" in out
    assert [(r["reason"], r["action"]) for r in job.ledger()] == [("completed", "finished")], job.why(info)


def _node_functions() -> str:
    """gpuguard_socket_ifname and gpuguard_route_dev as the rendered torchrun template defines them."""
    from gpuguard.templates import render_template

    text = render_template("torchrun.sbatch.j2", {"nodes": 2, "command": ["train.py"]})
    return text[text.index("gpuguard_socket_ifname() {"):text.index("gpuguard_visible() {")]


@pytest.mark.parametrize("preset_env, expect", [
    ({}, ("eth0", "=eth0")),
    ({"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "^docker"}, ("ib0", "^docker")),  # the user's choice
    ({"GPUGUARD_NCCL_IFNAME": "0"}, ("eth0", "")),  # an EFA preset: NCCL finds its own interfaces
])
def test_every_node_picks_its_interface_towards_the_rendezvous_unless_one_was_chosen(tmp_path, preset_env, expect):
    """Run on the head node (the rendezvous address is its own) and on the other node, each in its own namespace:
    both name the interface that carries their own address (never lo, although the head's route to its own
    address goes through lo), and a value the job set is kept."""
    from devtools.devnetns import NodeNetworks

    view = NodeNetworks()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    view.start(tmp_path, 2, env)
    try:
        script = _node_functions() + ('gpuguard_socket_ifname; echo "gloo=${GLOO_SOCKET_IFNAME:-} '
                                      'nccl=${NCCL_SOCKET_IFNAME:-}"')
        for index in (1, 2):
            r = subprocess.run(view.wrap_node(index, ["bash", "-c", script]), capture_output=True, text=True,
                               timeout=20, env={**env, "GPUGUARD_RDZV_ADDR": view.node_addr(1),
                                                "GPUGUARD_NCCL_IFNAME": "1", **preset_env})
            assert r.stdout.split() == [f"gloo={expect[0]}", f"nccl={expect[1]}"], (index, r.stdout, r.stderr)
    finally:
        view.stop()
