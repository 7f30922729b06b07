"""The dev cluster's nodes really apart: one network namespace per node, joined by a Linux bridge.

With the default dev cluster (and with `devtools.devhost.DebianHostView`) every node shares one network namespace,
so whatever one "node" listens on, every other node reaches, 127.0.1.1 included: a job that tells its peers a
loopback address (gloo resolving a stock Debian host name) works there and fails on a real cluster.
`NodeNetworks` gives each node what a real node has:

- its own network namespace, mount namespace and UTS namespace (a holder process per node, `unshare --net --mount
  --uts`, entered with `nsenter`; slurmd, hence every prolog, job step, torchrun and worker on that node, runs in
  them);
- one interface, `eth0` (a veth pair whose other end is plugged into a bridge in the machine's own namespace), with
  the node's own address on a private subnet (10.77.<n>.11, .12, ...; NodeAddr in slurm.conf);
- its own host name (the node's name) and a stock Debian /etc/hosts, bind-mounted in its mount namespace only:
  `127.0.0.1 localhost`, `127.0.1.1 <own name>`, and the other nodes' addresses (what a site's DNS would answer).

slurmctld, munged and the client commands (sbatch, scontrol) stay in the machine's namespace; slurmctld is reached
on the bridge's address (10.77.<n>.1). Traffic between nodes crosses the bridge, so one node's link can be slowed
(`slow_link`: a tc token-bucket filter on its veth) or cut (`cut_link`) and restored (`restore_link`). Nothing is
routed beyond the subnet: a job on a node cannot reach services on the machine's 127.0.0.1.

Clean-up: a node's namespaces go away with its holder and the processes in them; its veth goes with its network
namespace (the kernel may keep both a while, until orphaned connections to a node whose link was cut give up: link
names carry a per-cluster token and are never reused); `stop()` deletes the bridge. A bridge left behind by a killed test (its alias names the owner's pid) is
deleted by the next start. The machine's /etc/hosts, host name, addresses and routes are never touched. Named
network namespaces (`ip netns add`, /etc/netns/<name>/hosts) are not used: nothing would remove them after a
SIGKILL. Needs root, util-linux's unshare/nsenter/mount, iproute2's ip (and tc for `slow_link`), bridge and veth.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from devtools.devhost import STOCK_DEBIAN_HOSTS, missing_host_view_requirements, tool, wait_unshared

_ALIAS = "gpuguard-devcluster pid="
_LOCK = Path("/tmp/gpuguard-devcluster-netns.lock")


def node_hosts_file(own: str, others: Mapping[str, str]) -> str:
    """/etc/hosts of one node: Debian's installer's (own name on 127.0.1.1), then the other nodes (as DNS would)."""
    text = STOCK_DEBIAN_HOSTS.format(hostname=own)
    if others:
        text += "\n# the other nodes (a site's DNS)\n" + "".join(f"{addr}\t{name}\n" for name, addr in others.items())
    return text


def free_subnet_index(used_addresses: str, first: int = 1, last: int = 250) -> int:
    """The lowest n in [first, last] such that no address in `ip -o -4 addr` output is in 10.77.<n>.0/24."""
    taken = {int(m) for m in re.findall(r"inet 10\.77\.(\d+)\.", used_addresses)}
    for n in range(first, last + 1):
        if n not in taken:
            return n
    raise RuntimeError("no free 10.77.<n>.0/24 subnet for the dev cluster's bridge")


def stale_bridges(link_lines: str) -> list[str]:
    """Bridges named in `ip -o link show type bridge` output whose alias names a gpuguard dev cluster pid that no
    longer runs."""
    stale = []
    for line in link_lines.splitlines():
        name = re.match(r"\d+:\s+([^:@\s]+)", line)
        owner = re.search(re.escape(_ALIAS) + r"(\d+)", line)
        if name and owner and not Path(f"/proc/{owner.group(1)}").exists():
            stale.append(name.group(1))
    return stale


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([tool("ip"), *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@dataclass
class NodeNetworks:
    """Per-node network, mount and UTS namespaces on a bridge (see the module docstring). Pass as
    `DevCluster(host_view=NodeNetworks())` / `DevSite(host_view=...)`."""

    holders: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    subnet_index: int = 0
    names: list[str] = field(default_factory=list)
    # in the link names: a node's namespace can outlive the cluster for a while (the kernel keeps it, and its veth,
    # until orphaned TCP connections to a node whose link was cut give up), so names are never reused
    token: str = field(default_factory=lambda: os.urandom(3).hex())

    # ------------------------------------------------------------ what the cluster asks
    @property
    def hostname(self) -> str:
        """slurmctld's host: this machine (the controller stays in the machine's own namespaces)."""
        import socket

        return socket.gethostname().split(".")[0]

    @property
    def subnet(self) -> str:
        return f"10.77.{self.subnet_index}"

    @property
    def controller_addr(self) -> str:
        return f"{self.subnet}.1"

    @property
    def bridge(self) -> str:
        return f"ggb{self.token}"

    def node_addr(self, index: int) -> str:
        """NodeAddr of the index-th node (1-based)."""
        return f"{self.subnet}.{10 + index}"

    def node_hostname(self, index: int) -> str:
        return self.names[index - 1] if self.names else f"node{index}"

    def veth(self, index: int) -> str:
        """The machine-side end of the node's link (the one in the bridge)."""
        return f"gg{self.token}v{index}"

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """Client commands run in the machine's own namespaces."""
        return list(argv)

    def wrap_node(self, index: int, argv: Sequence[str]) -> list[str]:
        """`argv` run on the index-th node (its network, host name and /etc/hosts)."""
        return [tool("nsenter"), "-t", str(self.holders[index].pid), "-m", "-u", "-n", "--", *argv]

    # ------------------------------------------------------------ faults of the network
    def slow_link(self, index: int, rate: str = "1mbit") -> None:
        """Throttle the node's link both ways: a token-bucket filter on the veth's machine-side end shapes what
        the node receives, one on its eth0 what it sends (this kernel has no netem for delays)."""
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        for cmd in ([tool("tc"), "qdisc", "replace", "dev", self.veth(index), *tbf],
                    [*self._inside(index), tool("tc"), "qdisc", "replace", "dev", "eth0", *tbf]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=20)

    def cut_link(self, index: int) -> None:
        """The node's cable is pulled: nothing reaches it or leaves it until `restore_link`."""
        _ip("link", "set", self.veth(index), "down")

    def restore_link(self, index: int) -> None:
        for cmd in ([tool("tc"), "qdisc", "del", "dev", self.veth(index), "root"],
                    [*self._inside(index), tool("tc"), "qdisc", "del", "dev", "eth0", "root"]):
            subprocess.run(cmd, capture_output=True, timeout=20)
        _ip("link", "set", self.veth(index), "up")

    def _inside(self, index: int) -> list[str]:
        return [tool("nsenter"), "-t", str(self.holders[index].pid), "-n"]

    def node_pids(self, index: int) -> list[int]:
        """Every process on the index-th node (in its network namespace) but the namespaces' holder."""
        holder = self.holders[index].pid
        try:
            ns = os.readlink(f"/proc/{holder}/ns/net")
        except OSError:
            return []
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != holder:
                try:
                    if os.readlink(f"/proc/{entry}/ns/net") == ns:
                        pids.append(int(entry))
                except OSError:
                    pass
        return pids

    # ------------------------------------------------------------ lifecycle
    def start(self, workdir: Path, node_count: int, env: Mapping[str, str], timeout: float = 20.0,
              names: Optional[Sequence[str]] = None) -> None:
        missing = missing_host_view_requirements()
        if missing:
            raise RuntimeError("cannot give the nodes network namespaces: " + "; ".join(missing))
        self.names = list(names or [f"node{i}" for i in range(1, node_count + 1)])
        try:
            self._make_bridge()
            for index in range(1, node_count + 1):
                self._start_node(workdir, index, env, timeout)
        except BaseException:
            self.stop()
            raise

    def _make_bridge(self) -> None:
        with open(_LOCK, "w") as lock:  # two clusters starting at once must not pick the same subnet
            fcntl.flock(lock, fcntl.LOCK_EX)
            for name in stale_bridges(_ip("-o", "link", "show", "type", "bridge").stdout):
                _ip("link", "del", name, check=False)
            self.subnet_index = free_subnet_index(_ip("-o", "-4", "addr", "show").stdout)
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "alias", f"{_ALIAS}{os.getpid()}")
            _ip("addr", "add", f"{self.controller_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    def _start_node(self, workdir: Path, index: int, env: Mapping[str, str], timeout: float) -> None:
        own = self.node_hostname(index)
        hosts = workdir / f"hosts.{own}"
        hosts.write_text(node_hosts_file(own, {self.node_hostname(i): self.node_addr(i)
                                               for i in range(1, len(self.names) + 1) if i != index}))
        hosts.chmod(0o644)
        holder = subprocess.Popen(
            [tool("unshare"), "--mount", "--uts", "--net", "--propagation", "private", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(env),
            start_new_session=True)
        self.holders[index] = holder
        wait_unshared(holder, timeout)
        pid = str(holder.pid)
        inside = [tool("nsenter"), "-t", pid, "-n", tool("ip")]
        peer = f"gg{self.token}p{index}"
        _ip("link", "add", self.veth(index), "type", "veth", "peer", "name", peer, "netns", pid)
        _ip("link", "set", self.veth(index), "master", self.bridge)
        _ip("link", "set", self.veth(index), "up")
        steps = [
            [*inside, "link", "set", "lo", "up"],
            [*inside, "link", "set", peer, "name", "eth0"],
            [*inside, "addr", "add", f"{self.node_addr(index)}/24", "dev", "eth0"],
            [*inside, "link", "set", "eth0", "up"],
            [tool("nsenter"), "-t", pid, "-u", sys.executable, "-c",
             "import socket, sys; socket.sethostname(sys.argv[1])", own],
            [tool("nsenter"), "-t", pid, "-m", tool("mount"), "--bind", str(hosts), "/etc/hosts"],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(env))
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")

    def stop(self) -> None:
        """Kill the holders (the namespaces and veths go once nothing else runs in them) and delete the bridge."""
        for holder in self.holders.values():
            if holder.poll() is None:
                holder.kill()
            try:
                holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if holder.stderr:
                holder.stderr.close()
        self.holders.clear()
        if self.subnet_index:
            _ip("link", "del", self.bridge, check=False)
