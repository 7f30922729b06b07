"""Helpers of the pre-flight's tests on nodes really apart (test_preflight*_netns.py): a namespaced site configured
for gloo over CPU, one `gpuguard preflight` job, a watch on one node's pre-flight worker from outside.

Measured on the 2-core dev machine with a load average of 8-20 (other helpers' test suites): the persistent workers
are up in 8-13 s (torch's import on every node at once: the largest cost by far), each round then takes 0.3-1 s; the
healthy 4-node run reads 0.02-0.2 GB/s at 256 KiB, a node at 20 mbit ~0.002 GB/s; the floor sits between."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from torchjob import configure, netns_site

# the CI machine's 2 shared cores import torch on every node at once, slowly (seen: 20 s); the default is 20
BUDGET = 60
# 256 KiB at most: at 20 mbit (2.5 MB/s) a slowed node's runs finish in about a second and read ~0.002 GB/s; healthy
# gloo over the bridge read 0.007-0.2 GB/s on 2 loaded cores (a reading under the floor while its ranks waited for a
# CPU is "too slow to judge", not slow: judge.STARVED_SHARE); the floor sits between
NCCL = {"preflight_busbw_gbps": 0.005, "preflight_min_bytes": 65536, "preflight_max_bytes": 262144,
        "preflight_iterations": 2}


def pf_site(site_factory, nodes=4, floor=True):
    """`floor`: False judges hangs and failures only (no bandwidth floor)."""
    site = netns_site(site_factory, nodes=nodes)
    site.write_config({"nccl": NCCL if floor else {**NCCL, "preflight_busbw_gbps": None}})
    return site


def run_preflight(site, *sbatch_args: str, nodes: int = 4) -> tuple[str, float]:
    c = site.cluster
    script = (f"#!/bin/sh\n{sys.executable} -m gpuguard --config {site.config_path} preflight --budget {BUDGET} "
              f"--exclude-file {c.jobs_dir}/exclude-$SLURM_JOB_ID\necho preflight-rc=$?\n")
    start = time.monotonic()
    job = c.sbatch(script, f"-N{nodes}", "--time=3", *sbatch_args)
    info = c.wait_job(job, timeout=BUDGET + 60)
    took = time.monotonic() - start
    out = c.job_output(job)
    assert info["JobState"] == "COMPLETED", (info, out)
    return out, took



def preflight_samples(site, backend: str = "gloo") -> int:
    """How many `preflight` samples of `backend` `gpuguard baseline show` counts (4 nodes, the pre-flight's largest
    size)."""
    p = subprocess.run([sys.executable, "-m", "gpuguard", "--config", str(site.config_path), "baseline", "show",
                        "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [r for r in json.loads(p.stdout) if (r["n_nodes"], r["size_bytes"], r["backend"]) ==
            (4, NCCL["preflight_max_bytes"], backend)]
    return sum(int(part.split()[1]) for r in rows for part in r["sources"].split(", ") if part.startswith("preflight"))


def template_site(site_factory, nodes: int):
    site = netns_site(site_factory, nodes=nodes)
    configure(site, nccl=NCCL)
    return site


class WorkerWatch:
    """Watches node `node`'s pre-flight worker (the persistent python process, not its srun on the batch node) and
    its collective children from this test, polling /proc (this site's cluster only: its workers dial its subnet):
    `on_child(pid)` when a collective child appears, `on_child_end()` when the first one is gone."""

    def __init__(self, site, node: str, on_child=None, on_child_end=None) -> None:
        self.node, self.on_child, self.on_child_end = node, on_child, on_child_end
        # this cluster's workers only (other tests' clusters run the same command line): they dial its subnet
        self.coordinator = f"{site.cluster.host_view.subnet}.".encode()
        self.worker = None
        self.seen: list[int] = []  # collective children, in order
        self.other: list[int] = []  # anything else it ran
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _find(self):
        for e in os.listdir("/proc"):
            try:
                argv = open(f"/proc/{e}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"gpuguard.preflight.worker" in argv and b"srun" not in os.path.basename(argv[0]) and \
                    self.node.encode() in argv and b"--coordinator" in argv[:-1] and \
                    argv[argv.index(b"--coordinator") + 1].startswith(self.coordinator):
                return int(e)
        return None

    def is_collective(self, k: int) -> bool:
        """A forked collective: the worker's own command line and torch mapped (the `ip` the worker runs at its start
        is forked before torch's import, and execs)."""
        try:
            mine = open(f"/proc/{self.worker}/cmdline", "rb").read()
            return open(f"/proc/{k}/cmdline", "rb").read() == mine and b"libtorch" in open(f"/proc/{k}/maps",
                                                                                          "rb").read()
        except OSError:
            return False

    def children(self):
        try:
            return [int(p) for p in open(f"/proc/{self.worker}/task/{self.worker}/children").read().split()]
        except (OSError, TypeError):
            return []

    def _run(self):
        until = time.monotonic() + 120
        while not self.done.is_set() and time.monotonic() < until:
            if self.worker is None:
                self.worker = self._find()
            else:
                for k in self.children():
                    if k not in self.seen and k not in self.other and not self.is_collective(k):
                        self.other.append(k)
                    elif k not in self.seen and k not in self.other:
                        self.seen.append(k)
                        if self.on_child:
                            self.on_child(self, k)
                        if len(self.seen) == 1 and self.on_child_end:
                            self._until_gone(k)
                            self.on_child_end(self)
                            self.on_child_end = None
            time.sleep(0.005)

    @staticmethod
    def _until_gone(pid: int) -> None:
        """Back the moment `pid` exits (a pidfd reads ready then), not a poll later."""
        import select

        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        try:
            select.select([fd], [], [], 60)
        finally:
            os.close(fd)

    def stop(self):
        self.done.set()
        self.thread.join(5)



def unthrottle(view, index: int) -> None:
    """restore_link's tc deletes, both at once (the re-test rounds follow the first within a second)."""
    from devtools.devhost import tool

    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in (
        [tool("tc"), "qdisc", "del", "dev", view.veth(index), "root"],
        [*view._inside(index), tool("tc"), "qdisc", "del", "dev", "eth0", "root"])]
    for p in procs:
        p.wait(20)

