"""`gpuguard preflight` on nodes really apart (devtools.devnetns.NodeNetworks): gloo over CPU between 3-4 nodes, one
node's link slowed with tc tbf, cut, or its worker frozen (SIGSTOP) in the middle of the collective; the pre-flight
blames that node (and no other) within its budget and drains it as a standing condition of the node, a healthy
allocation passes, and a one-off (a link slow for the first round only) drains nothing.

Measured on the 2-core dev machine with a load average of 12-20 (other helpers' test suites): the persistent workers
are up in 8-12 s (torch's import on every node at once: the largest cost by far), each round then takes 0.3-1 s; the
healthy 4-node run reads 0.03-0.08 GB/s at 256 KiB, node3 at 20 mbit ~0.002 GB/s; the floor sits between."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time

import pytest
from torchjob import NEEDS_HOST_VIEW, NEEDS_TORCH, netns_site

pytestmark = [NEEDS_HOST_VIEW, NEEDS_TORCH]

BUDGET = 45  # the CI machine's 2 shared cores import torch on every node at once, slowly; the default is 20


def _site(site_factory, nodes=4):
    site = netns_site(site_factory, nodes=nodes)
    # 256 KiB at most: at 20 mbit (2.5 MB/s) node3's runs finish in about a second and read ~0.003 GB/s, ten times
    # under the floor; healthy gloo over the bridge reads well above it even on 2 loaded cores
    site.write_config({"nccl": {"preflight_busbw_gbps": 0.008, "preflight_min_bytes": 65536,
                                "preflight_max_bytes": 262144, "preflight_iterations": 2}})
    return site


def _preflight(site, *sbatch_args: str, nodes: int = 4) -> tuple[str, float]:
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


@pytest.mark.slow(90)
def test_a_healthy_allocation_passes_within_budget_and_a_slowed_node_is_blamed_and_drained(site_factory):
    site = _site(site_factory)
    out, took = _preflight(site)
    print(f"healthy: {took:.1f}s from sbatch: {out}")
    assert re.search(r"gpuguard preflight: 4 nodes node\[1-4\] in [\d.]+s: passed, busbw", out), out
    assert "preflight-rc=0" in out and took < BUDGET + 30, (out, took)

    site.cluster.host_view.slow_link(3, "20mbit")
    out, took = _preflight(site)
    print(f"node3 slowed: {took:.1f}s from sbatch: {out}")
    spent = float(re.search(r"in ([\d.]+)s: ", out).group(1))
    assert spent <= BUDGET, out  # blame and drain included
    assert re.search(r"blamed node3 \(NCCL fabric.nccl: busbw [\d.]+ GB/s vs [\d.]+ with peers", out), out
    assert "GPUGUARD_PREFLIGHT_EXCLUDE=node3" in out and "preflight-rc=10" in out, out
    node = site.cluster.nodes_info()["node3"]
    assert "DRAIN" in node["State"] and node["Reason"].startswith("gpuguard: NCCL fabric.nccl: busbw"), node
    journal = json.loads((site.workdir / "run" / "node3.journal.json").read_text())
    others = [n for n in ("node1", "node2", "node4") if "DRAIN" in site.cluster.nodes_info()[n]["State"]]
    assert others == [], out
    assert any(c["origin"] == "preflight" and c["check_id"] == "fabric.nccl"
                                  for c in journal.get("conditions", [])), journal


@pytest.mark.slow(60)
def test_a_node_cut_off_is_blamed_within_budget_and_the_others_are_not(site_factory):
    """node3's cable pulled: its steps cannot even start (srun fails to reach its slurmd). The pre-flight names it
    within its budget, never hangs the job start, and drains it from the batch node (it cannot run the record
    step itself); no other node is blamed. --no-kill: Slurm must not end the job itself when it marks node3 down."""
    site = _site(site_factory)
    site.cluster.host_view.cut_link(3)
    out, took = _preflight(site, "--no-kill")
    print(f"node3 cut: {took:.1f}s from sbatch: {out}")
    assert re.search(r"blamed node3 \(NCCL fabric.nccl: hang or failure", out), out
    assert float(re.search(r"in ([\d.]+)s: ", out).group(1)) <= BUDGET, out
    assert "GPUGUARD_PREFLIGHT_EXCLUDE=node3\n" in out and "preflight-rc=10" in out, out
    info = site.cluster.nodes_info()
    assert info["node3"]["Reason"].startswith("gpuguard: NCCL fabric.nccl: hang or failure"), info["node3"]
    assert [n for n in ("node1", "node2", "node4") if "DRAIN" in info[n]["State"]] == [], out


class WorkerWatch:
    """Watches node `node`'s pre-flight worker (the persistent python process, not its srun on the batch node) and
    its collective children from this test, polling /proc: `on_child(pid)` when a collective child appears,
    `on_child_end()` when the first one is gone."""

    def __init__(self, node: str, on_child=None, on_child_end=None) -> None:
        self.node, self.on_child, self.on_child_end = node, on_child, on_child_end
        self.worker = None
        self.seen: list[int] = []
        self.candidates: dict[int, float] = {}
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
                    self.node.encode() in argv:
                return int(e)
        return None

    def children(self):
        """The worker's forked collectives (its own command line: not the `ip` it runs at its start)."""
        try:
            kids = [int(p) for p in open(f"/proc/{self.worker}/task/{self.worker}/children").read().split()]
            mine = open(f"/proc/{self.worker}/cmdline", "rb").read()
        except (OSError, TypeError):
            return []
        out = []
        for k in kids:
            try:
                if open(f"/proc/{k}/cmdline", "rb").read() == mine:
                    out.append(k)
            except OSError:
                pass
        return out

    def _run(self):
        until = time.monotonic() + 120
        while not self.done.is_set() and time.monotonic() < until:
            if self.worker is None:
                self.worker = self._find()
            else:
                kids = self.children()
                for k in kids:
                    # a collective, not a subprocess between its fork and its exec: still the worker 20 ms on
                    since = self.candidates.setdefault(k, time.monotonic())
                    if k not in self.seen and time.monotonic() - since >= 0.02:
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


@pytest.mark.slow(60)
def test_a_node_whose_collective_hangs_is_blamed_within_budget(site_factory):
    """node3's worker frozen (SIGSTOP, it and its collective) the moment its first collective starts: the all-node
    round hangs with its link up. The pre-flight stops that round (too slow to judge: nothing beside it), re-tests
    in smaller groups, and blames node3 alone as a hang within its budget: never a hung job start."""
    site = _site(site_factory, nodes=3)
    frozen = []

    def freeze(w, child):
        for pid in (w.worker, child):
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)

    watch = WorkerWatch("node3", on_child=freeze)
    try:
        out, took = _preflight(site, "--no-kill", nodes=3)
    finally:
        watch.stop()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"node3 frozen: {took:.1f}s from sbatch: {out}")
    assert frozen, "node3's worker never ran a collective"
    assert re.search(r"blamed node3 \(NCCL fabric.nccl: hang or failure \(hung: ", out), out
    assert float(re.search(r"in ([\d.]+)s: ", out).group(1)) <= BUDGET, out
    assert "GPUGUARD_PREFLIGHT_EXCLUDE=node3\n" in out and "preflight-rc=10" in out, out
    info = site.cluster.nodes_info()
    assert [n for n in ("node1", "node2") if "DRAIN" in info[n]["State"]] == [], out


def _unthrottle(view, index: int) -> None:
    """restore_link's tc deletes, both at once (the re-test rounds follow the first within a second)."""
    import subprocess

    from devtools.devhost import tool

    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in (
        [tool("tc"), "qdisc", "del", "dev", view.veth(index), "root"],
        [*view._inside(index), tool("tc"), "qdisc", "del", "dev", "eth0", "root"])]
    for p in procs:
        p.wait(20)


@pytest.mark.slow(60)
def test_a_one_off_slow_first_round_drains_nothing(site_factory):
    """node3's link slow while the all-node round runs, restored the moment node3's part of it ends: the pair round
    may still see node3 slow (node3,node4), the confirm runs beside known-good nodes find every node at full speed,
    so the pre-flight lets the job run and drains nothing."""
    site = _site(site_factory)
    site.cluster.host_view.slow_link(3, "20mbit")
    watch = WorkerWatch("node3", on_child_end=lambda w: _unthrottle(site.cluster.host_view, 3))
    try:
        out, took = _preflight(site)
    finally:
        watch.stop()
        site.cluster.host_view.restore_link(3)
    print(f"node3 slow once: {took:.1f}s from sbatch: {out}")
    assert re.search(r"in [\d.]+s: nothing reproducible", out), out
    assert "preflight-rc=0" in out and "GPUGUARD_PREFLIGHT_EXCLUDE" not in out, out
    info = site.cluster.nodes_info()
    assert [n for n in ("node1", "node2", "node3", "node4") if "DRAIN" in info[n]["State"]] == [], out


def test_a_two_node_template_job_runs_the_preflight_before_training(site_factory):
    """Issue 28: the torchrun template runs the pre-flight by default for 2+ nodes (a 2-node job), it passes, and
    the training starts after it."""
    from torchjob import Job

    site = netns_site(site_factory, nodes=2)
    job = Job(site, steps=4, step_time=0.2, max_failures=0, preflight="default", preflight_budget_s=BUDGET)
    info = job.wait(timeout=240)
    out = job.output()
    assert info["JobState"] == "COMPLETED", job.why(info)
    pre = re.search(r"^gpuguard preflight: 2 nodes node\[1-2\] in ([\d.]+)s: passed", out, re.M)
    assert pre and float(pre.group(1)) <= BUDGET, job.why(info)
    trained = re.search(r"\[rank\d\]: rank \d/2 on node", out)
    assert trained and pre.start() < trained.start(), job.why(info)  # before the training


def _template_site(site_factory, nodes: int):
    from torchjob import configure

    site = netns_site(site_factory, nodes=nodes)
    configure(site, nccl={"preflight_busbw_gbps": 0.008, "preflight_min_bytes": 65536,
                          "preflight_max_bytes": 262144, "preflight_iterations": 2})
    return site


@pytest.mark.slow(240)
def test_a_slowed_node_is_blamed_and_the_job_requeued_without_it_completes(site_factory):
    """Issue 28: a 3-node template job on a 4-node cluster lands on node[1-3] with node3's link slowed: the
    pre-flight blames node3 and drains it, the attempt ends (event preflight, a failure of max_failures, the ledger
    says why), the job is requeued without node3, passes the pre-flight on node[1-2,4] and trains to completion."""
    from torchjob import Job

    site = _template_site(site_factory, 4)
    site.cluster.host_view.slow_link(3, "20mbit")
    job = Job(site, nodes=3, steps=4, step_time=0.2, max_failures=2, preflight="default", preflight_budget_s=BUDGET)
    info = job.wait(timeout=360)
    out, ledger = job.output(), job.ledger()
    assert info["JobState"] == "COMPLETED", job.why(info)
    assert [(r["attempt"], r["reason"], r["event"]) for r in ledger][:1] == [(1, "preflight", "preflight")], \
        job.why(info)
    assert ledger[-1]["reason"] == "completed" and "node3" not in info["NodeList"], job.why(info)
    assert re.search(r"gpuguard preflight: 3 nodes node\[1-3\] in [\d.]+s: blamed node3 \(", out), job.why(info)
    assert re.search(r"gpuguard preflight: 3 nodes node\[1-2,4\] in [\d.]+s: passed", out), job.why(info)
    assert "DRAIN" in site.cluster.nodes_info()["node3"]["State"]


@pytest.mark.slow(180)
def test_with_min_nodes_the_training_goes_on_without_the_blamed_node(site_factory):
    """Issue 28 item 3: a 3-node template job with min_nodes 2 and node3's link slowed: the pre-flight blames node3,
    and the training runs at once on node[1-2] in the same allocation (one attempt, no requeue)."""
    from torchjob import Job

    site = _template_site(site_factory, 3)
    site.cluster.host_view.slow_link(3, "20mbit")
    job = Job(site, nodes=3, min_nodes=2, steps=4, step_time=0.2, max_failures=0, preflight="default",
              preflight_budget_s=BUDGET)
    info = job.wait(timeout=300)
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", job.why(info)
    assert re.search(r"gpuguard preflight: 3 nodes node\[1-3\] in [\d.]+s: blamed node3 \(", out), job.why(info)
    assert "the training goes on without it on 2 of 3 nodes (min_nodes 2)" in out, job.why(info)
    ranks = set(re.findall(r"\[rank\d\]: rank \d/(\d) on (node\d)", out))
    assert ranks == {("2", "node1"), ("2", "node2")}, job.why(info)


@pytest.mark.slow(60)
def test_the_nodes_under_one_switch_slowed_together_blame_the_switch(site_factory):
    """Issue 28: topology.conf puts node[1-2] under leafA and node[3-4] under leafB; both of leafB's links slowed.
    The pre-flight blames the switch, not its nodes: no node drained, one page (`gpuguard: NETWORK switch leafB`)
    to the site's receiver, leafB's nodes excluded from this job only."""
    from notify_servers import WebhookServer

    hook = WebhookServer(host="0.0.0.0")  # the batch node dials the bridge's address, not this machine's loopback
    try:
        site = netns_site(site_factory, nodes=4, topology={"leafA": "node[1-2]", "leafB": "node[3-4]"})
        view = site.cluster.host_view
        site.write_config({"nccl": {"preflight_busbw_gbps": 0.008, "preflight_min_bytes": 65536,
                                    "preflight_max_bytes": 262144, "preflight_iterations": 2},
                           "notify": {"urls": [hook.url("/pages", view.controller_addr)]}})
        view.slow_link(3, "20mbit")
        view.slow_link(4, "20mbit")
        out, took = _preflight(site)
        print(f"leafB slowed: {took:.1f}s from sbatch: {out}")
        assert re.search(r"in [\d.]+s: blamed leafB \(switch leafB: its nodes slow together, no node drained\).*; "
                         r"page: sent", out), out
        assert "GPUGUARD_PREFLIGHT_EXCLUDE=node[3-4]\n" in out and "preflight-rc=10" in out, out
        info = site.cluster.nodes_info()
        assert [n for n in info if "DRAIN" in info[n]["State"]] == [], out
        pages = [r for r in hook.requests if "NETWORK switch leafB" in json.dumps(r["body"])]
        assert len(pages) == 1, (hook.requests, out)
    finally:
        hook.close()
