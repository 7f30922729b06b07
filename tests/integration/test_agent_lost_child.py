"""Issue 27 item 4: the node agent's child lost mid-prolog (the agent unit restarted, an OOM kill) while NVML had not
answered. The hook runs again in its own process with the time left; that run must judge a hung NVML as a hung NVML
(gpu.nvml TIMEOUT: drained) within the time left, never be ended by its watchdog with exit 0 and no verdict, so that
the job runs on the node."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from gpuguard.slurm.reason import parse_reason
from test_agent import _alive, children_of, slow_nvml  # noqa: F401 - same directory (pytest rootdir-relative)


def _hook_children(agent_pid: int, timeout: float) -> list[int]:
    """The agent's children serving a hook (its listening probes' children end within milliseconds)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        kids = [pid for pid in children_of(agent_pid) if _alive(pid)]
        if kids:
            time.sleep(0.3)
            kids = [pid for pid in kids if _alive(pid)]
            if kids:
                return kids
        time.sleep(0.05)
    raise AssertionError("the agent forked no child for the prolog")


@pytest.mark.slow(25)
def test_a_child_lost_late_while_nvml_hangs_drains_and_the_job_never_runs(site_factory: Any):
    # the 30 s prolog with a 10 s NVML budget (+10 s grace), killed 12 s in, at half scale: the hook's own
    # re-run must still get NVML judged (hung) inside the hook's deadline
    site = site_factory(nodes=1, agent=True, config={"deadlines": {"prolog_s": 15.0, "nvml_s": 5.0,
                                                                   "scontrol_s": 5.0}})
    assert site.agent is not None
    slow_nvml(site, "node1", 600)  # nvmlInit never answers: a wedged GPU
    job = site.cluster.sbatch("#!/bin/sh\necho ran-on-$(hostname)\n", "-N1", "--gres=gpu:8")
    kids = _hook_children(site.agent.pid, timeout=30)
    started = time.monotonic()
    time.sleep(8.0)  # the child has waited 8 s in nvmlInit: its 5 s + 5 s grace are not over yet
    for pid in kids:
        os.kill(pid, signal.SIGKILL)  # the agent unit restarted, or the OOM killer
    killed_at = time.monotonic() - started

    until = time.monotonic() + 40
    while time.monotonic() < until and "DRAIN" not in site.cluster.node_flags("node1"):
        time.sleep(0.5)
    time.sleep(2.0)  # had the prolog passed, the job would have run by now
    info = site.cluster.job_info(job)
    reason = site.cluster.node_info("node1").get("Reason", "")
    lines = site.log_lines("prolog node=node1")
    assert info["JobState"] not in ("RUNNING", "COMPLETING", "COMPLETED"), (info, lines)
    assert not (site.cluster.jobs_dir / f"slurm-{job}.out").exists() or \
        "ran-on" not in site.cluster.job_output(job)
    parsed = parse_reason(reason)
    assert parsed is not None and parsed.check_id == "gpu.nvml" and parsed.keyword == "TIMEOUT", (reason, lines)
    # the verdict came from the hook's own process (its re-run), not from the watchdog
    assert [line for line in lines if "verdict=drain" in line and "via=agent" not in line], lines
    assert not site.log_lines("deadline of"), site.log_lines("deadline of")
    assert killed_at < 10.0  # the kill really came while the child's NVML had not answered
