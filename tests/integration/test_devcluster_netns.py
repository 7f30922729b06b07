"""The dev cluster with its nodes really apart (devtools.devnetns.NodeNetworks): each node's slurmd, and so each job
step, in its own network, UTS and mount namespaces, joined by a bridge; what a job sees there is what it sees on a
stock Debian cluster, and the links can be slowed or cut. Nothing of it is left once the cluster stops."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from devtools.devcluster import DevCluster
from devtools.devhost import missing_host_view_requirements
from devtools.devnetns import NodeNetworks, free_subnet_index, node_hosts_file, stale_bridges

NEEDS_NETNS = pytest.mark.skipif(bool(missing_host_view_requirements()) or os.geteuid() != 0,
                                 reason="per-node namespaces need root, unshare, nsenter and ip")

# what a job step does on each node: who am I, what does my own name resolve to, and can I reach the other node
PROBE = r"""
import socket, sys, time
me = socket.gethostname()
print("name", me, "resolves", socket.gethostbyname(me), flush=True)
if sys.argv[1] == "serve":
    srv = socket.create_server(("0.0.0.0", int(sys.argv[2])))
    srv.settimeout(20)
    got = 0
    while not got:  # the peer's reachability check first (no data), then the transfer
        conn, peer = srv.accept()
        start = time.monotonic()
        while data := conn.recv(65536):
            got += len(data)
    print("served", got, "from", peer[0], f"in {time.monotonic() - start:.2f}", flush=True)
else:
    host, port = sys.argv[2], int(sys.argv[3])
    for target in (me, host):   # my own name (127.0.1.1 on Debian) first, then the peer's real address
        try:
            with socket.create_connection((target if target != me else socket.gethostbyname(me), port), timeout=3):
                pass
            print("reached", target, flush=True)
        except OSError as e:
            print("refused", target, type(e).__name__, flush=True)
    time.sleep(0.5)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"x" * int(sys.argv[4]))
"""


def test_helpers_pick_a_free_subnet_and_find_stale_bridges():
    addrs = "1: lo    inet 127.0.0.1/8 scope host lo\n7: ggnb1    inet 10.77.1.1/24 scope global ggnb1\n"
    assert free_subnet_index(addrs) == 2
    links = ("9: ggnb3: <BROADCAST> mtu 1500 qdisc noop state DOWN \\    link/ether 02:00:00:00:00:01 brd "
             "ff:ff:ff:ff:ff:ff alias gpuguard-devcluster pid=999999999\n"
             f"10: ggnb4: <BROADCAST> mtu 1500 alias gpuguard-devcluster pid={os.getpid()}\n11: docker0: <UP>\n")
    assert stale_bridges(links) == ["ggnb3"]
    hosts = node_hosts_file("node1", {"node2": "10.77.1.12"})
    assert "127.0.1.1\tnode1\n" in hosts and "10.77.1.12\tnode2\n" in hosts and "10.77.1.11" not in hosts


@NEEDS_NETNS
@pytest.mark.slow(25)
def test_nodes_have_their_own_network_name_and_hosts_and_a_link_that_can_be_slowed_or_cut(tmp_path):
    view = NodeNetworks()
    with DevCluster(nodes=2, gpus_per_node=0, host_view=view, workdir=tmp_path / "c") as c:
        bridge = view.bridge
        info = c.nodes_info()
        assert [(info[n]["NodeAddr"], info[n]["NodeHostName"]) for n in ("node1", "node2")] == [
            (view.node_addr(1), "node1"), (view.node_addr(2), "node2")]
        probe = c.jobs_dir / "probe.py"
        probe.write_text(PROBE)
        port = 30123
        size = 400_000  # 0.4 MB: about 0.4 s at 8 Mbit/s, a few ms unthrottled
        script = (f"#!/bin/sh\nsrun -N1 -n1 -w node2 python3 {probe} serve {port} &\nsleep 1\n"
                  f"srun -N1 -n1 -w node1 python3 {probe} connect {view.node_addr(2)} {port} {size}\nwait\n")
        fast = c.job_output(_run(c, script))
        # each node is itself, its own name on 127.0.1.1 as Debian writes it; the other node's loopback is not ours
        assert "name node1 resolves 127.0.1.1" in fast and "name node2 resolves 127.0.1.1" in fast, fast
        assert "refused node1 ConnectionRefusedError" in fast and f"reached {view.node_addr(2)}" in fast, fast
        assert f"served {size} from {view.node_addr(1)} in" in fast, fast
        view.slow_link(1, "8mbit")
        slow = c.job_output(_run(c, script))
        view.restore_link(1)
        assert _seconds(slow) > 5 * _seconds(fast) and _seconds(slow) > 0.2, (fast, slow)
        # a cut link: node1's slurmd no longer answers, while node2 does
        view.cut_link(1)
        r = subprocess.run(c.node_command("node2", ["python3", "-c", f"import socket; socket.create_connection(("
                                                    f"'{view.node_addr(1)}', {c.node_ports['node1']}), timeout=2)"]),
                           capture_output=True, text=True, timeout=20)
        assert "timed out" in r.stderr or "No route" in r.stderr or "unreachable" in r.stderr, r.stderr
        view.restore_link(1)
    left = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert bridge not in left and not view.holders
    assert not c.stray_processes()


def _run(c: DevCluster, script: str) -> str:
    job = c.sbatch(script, "-N2", "--time=2")
    info = c.wait_job(job, timeout=60)
    assert info["JobState"] == "COMPLETED", (info, c.job_output(job))
    return job


def _seconds(out: str) -> float:
    return float(out.split(" in ")[1].split()[0])
