"""The dev cluster on a host laid out like a stock Debian/Ubuntu node, without touching this machine's own setup.

A Debian or Ubuntu installer writes `127.0.1.1 <hostname>` into /etc/hosts, so a node's own name resolves to a
loopback address, while Slurm reaches the node at its real address (NodeAddr). Software that asks "is this
address mine?" by resolving gethostname() (torchrun's c10d rendezvous does) answers no on every node. The default
dev cluster cannot show this: every node is at 127.0.0.1 and the host's name resolves to 127.0.0.1 too.

`DebianHostView` gives the cluster its own view of a host: the daemons (and so every prolog, job and torchrun)
run in private mount, UTS and network namespaces (`unshare`, entered with `nsenter`) where
- the host name is `hostname` and a bind-mounted /etc/hosts is the stock Debian one (`127.0.1.1 <hostname>`);
- each node has its own non-loopback address (TEST-NET-1, RFC 5737: 192.0.2.11, .12, ...) on the namespace's
  loopback device, as NodeAddr, like nodes at distinct addresses on a real network.
Nothing leaves the namespace (it has no other device); the machine's /etc/hosts, host name and network are not
changed. Needs root, util-linux's unshare/nsenter and iproute2's ip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

# /etc/hosts as Debian 12's installer writes it (and Ubuntu's): the host's own name on 127.0.1.1.
STOCK_DEBIAN_HOSTS = """127.0.0.1\tlocalhost
127.0.1.1\t{hostname}

# The following lines are desirable for IPv6 capable hosts
::1     localhost ip6-localhost ip6-loopback
ff02::1 ip6-allnodes
ff02::2 ip6-allrouters
"""

TOOLS = ("unshare", "nsenter", "ip")


def missing_host_view_requirements() -> list[str]:
    """Why a DebianHostView cannot be set up here (empty list = it can)."""
    path = "/usr/sbin:/sbin:/usr/bin:/bin"
    return [f"{tool} not found (util-linux / iproute2)" for tool in TOOLS if shutil.which(tool, path=path) is None]


def tool(name: str) -> str:
    return shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin") or name


@dataclass
class DebianHostView:
    hostname: str = "gg-debian"
    subnet: str = "192.0.2"  # TEST-NET-1: documentation addresses, only ever inside the private namespace
    holder: Optional[subprocess.Popen[bytes]] = field(default=None, repr=False)

    def node_addr(self, index: int) -> str:
        """NodeAddr of the index-th node (1-based)."""
        return f"{self.subnet}.{10 + index}"

    @property
    def pid(self) -> int:
        if self.holder is None:
            raise RuntimeError("DebianHostView not started")
        return self.holder.pid

    @property
    def controller_addr(self) -> str:
        return "127.0.0.1"

    def node_hostname(self, index: int) -> str:
        """Every node of this view runs on the one host."""
        return self.hostname

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the view (its host name, /etc/hosts and addresses)."""
        return [tool("nsenter"), "-t", str(self.pid), "-m", "-u", "-n", "--", *argv]

    def wrap_node(self, index: int, argv: Sequence[str]) -> list[str]:
        return self.wrap(argv)

    def start(self, workdir: Path, node_count: int, env: Mapping[str, str], timeout: float = 20.0,
              names: Optional[Sequence[str]] = None) -> None:
        """Create the namespaces (held by a sleeping process) and lay the host out in them."""
        missing = missing_host_view_requirements()
        if missing:
            raise RuntimeError("cannot lay out a Debian-like host: " + "; ".join(missing))
        hosts = workdir / "hosts"
        hosts.write_text(STOCK_DEBIAN_HOSTS.format(hostname=self.hostname))
        hosts.chmod(0o644)
        self.holder = subprocess.Popen(
            [tool("unshare"), "--mount", "--uts", "--net", "--propagation", "private", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(env),
            start_new_session=True)
        enter = [tool("nsenter"), "-t", str(self.holder.pid)]
        steps: list[list[str]] = [
            [*enter, "-n", tool("ip"), "link", "set", "lo", "up"],
            *([*enter, "-n", tool("ip"), "addr", "add", f"{self.node_addr(i)}/32", "dev", "lo"]
              for i in range(1, node_count + 1)),
            [*enter, "-u", sys.executable, "-c", "import socket, sys; socket.sethostname(sys.argv[1])",
             self.hostname],
            [*enter, "-m", tool("mount"), "--bind", str(hosts), "/etc/hosts"],
        ]
        try:
            assert self.holder is not None
            wait_unshared(self.holder, timeout)
            for cmd in steps:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(env))
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.holder is None:
            return
        if self.holder.poll() is None:
            self.holder.kill()
        try:
            self.holder.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.holder.stderr:
            self.holder.stderr.close()


def wait_unshared(holder: "subprocess.Popen[bytes]", timeout: float) -> None:
    """unshare execs sleep only once the namespaces exist: wait until the holder's network namespace differs from
    ours (raises when it died or took longer than `timeout`)."""
    import os
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            err = holder.stderr.read().decode(errors="replace") if holder.stderr else ""
            raise RuntimeError(f"unshare exited with {holder.returncode}: {err.strip()}")
        try:
            if os.readlink(f"/proc/{holder.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"unshare did not create the namespaces within {timeout}s")
