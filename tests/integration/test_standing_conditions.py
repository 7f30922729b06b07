"""A fault stands until what clears it is seen (issue 27), on the real local Slurm cluster with real jobs.

Each test is an admin's everyday action, or an ordinary coincidence, that let a job start on a GPU with a fresh
fatal fault before node conditions existed: a plain `scontrol update state=resume`, Slurm's own "Prolog error"
drain, two hooks in the same second, the watch daemon's first start, `gpuguard undrain` without a GPU reset, and a
kept drain that cost the whole node table on every health check. In none of them may a job run on the node while
its condition stands; what clears it (a GPU reset, a reboot, an admin's recorded undrain) returns the node.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from nodeview import drained, reason
from watchproc import wait_for

from devtools.devsite import DevSite
from gpuguard.util.fs import atomic_write

XID119 = ("NVRM: Xid (PCI:0000:86:00): 119, pid=2113, name=python3, Timeout after 6s of waiting for RPC response "
          "from GPU3 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x204).")
XID48 = ("NVRM: Xid (PCI:0000:a8:00): 48, pid=25812, name=python3, An uncorrectable double bit error (DBE) has been "
         "detected on GPU in the framebuffer at partition 4, subpartition 1.")
JOB = "#!/bin/sh\necho ran on $SLURMD_NODENAME\n"
FAST = {"deadlines": {"scontrol_s": 2.0}}


def add_kernel_lines(site: DevSite, node: str, *lines: str) -> None:
    path = site.scenarios / f"{node}.yaml"
    data: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    data["kernel_log"] = list(data.get("kernel_log") or []) + list(lines)
    atomic_write(path, yaml.safe_dump(data, sort_keys=False))


def job_env(job: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": "0,1", "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0"}


def run_hook(site: DevSite, kind: str, node: str = "node1", job: str = "") -> subprocess.CompletedProcess[str]:
    return site.run_hook(kind, node, timeout=90, **(job_env(job) if kind != "healthcheck" else {}))


def start_hook(site: DevSite, kind: str, node: str = "node1", job: str = "") -> subprocess.Popen[str]:
    """A hook started the way slurmd starts it, not waited for (several at once)."""
    env = site.hook_env(node, kind, **(job_env(job) if kind != "healthcheck" else {}))
    return subprocess.Popen(site.cluster.command([str(site.libexec / f"gpuguard-{kind}")]), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")


def reload_driver(site: DevSite, node: str) -> None:
    """The GPU reset NVIDIA documents (the driver unloaded and loaded again): a new nvidia module directory."""
    module = site.workdir / "sim" / node / "sys" / "module" / "nvidia"
    module.rename(module.with_name(f"nvidia.unloaded-{time.monotonic_ns()}"))  # kept: its inode is not reused
    module.mkdir()


def ran(site: DevSite, job: str) -> bool:
    out = Path(site.cluster.jobs_dir) / f"slurm-{job}.out"
    return out.exists() and "ran on" in out.read_text()


def raw_reason(site: DevSite, node: str = "node1") -> str:
    return site.cluster.node_info(node).get("Reason", "")


def drained_by_xid(site: DevSite, keyword: str, node: str = "node1") -> None:
    assert run_hook(site, "healthcheck", node).returncode in (0, 1)  # healthy: the kernel-log position is known
    add_kernel_lines(site, node, XID119 if keyword == "XID119" else XID48)
    run_hook(site, "healthcheck", node)
    r = reason(site, node)
    assert drained(site, node) and r is not None and r.keyword == keyword, site.cluster.node_info(node)


def no_job_ran(site: DevSite, *jobs: str, settle: float = 2.0) -> None:
    time.sleep(settle)
    for job in jobs:
        assert not ran(site, job), (job, site.cluster.job_info(job))
        site.cluster.run(["scancel", job])


# --------------------------------------------------------------------------- 1. a plain resume


@pytest.mark.slow(25)
def test_a_plain_resume_is_drained_again_and_only_a_gpu_reset_returns_the_node(site_factory):
    """The everyday `scontrol update state=resume` after an Xid 119: the next job's prolog drains the node again,
    saying how to clear the condition, and the job does not run there. A health check keeps the drain; `gpuguard
    undrain` is refused until a GPU reset is seen; after the reset it lifts the drain and a job runs."""
    site = site_factory(nodes=2, config=FAST)
    drained_by_xid(site, "XID119")
    site.cluster.resume("node1")
    job = site.cluster.sbatch(JOB, "-w", "node1", "--requeue")
    site.cluster.wait_nodes(lambda f: "DRAIN" in f, nodes=["node1"], timeout=30)
    assert "reset GPU then gpuguard undrain node1" in raw_reason(site) and "[standing reset]" in raw_reason(site)
    # the prolog logs its result line after it drained (Slurm may show the drain first)
    wait_for(lambda: [line for line in site.log_lines(f"prolog node=node1 job={job} ") if "verdict=refused" in line
                      and "slurm=redrained" in line], 10, "the prolog's refused/redrained line")
    no_job_ran(site, job)
    # an admin's undrain without the reset is refused (no health check saw the driver in between: the loaded
    # module is compared with the one the condition was found under); a health check keeps the drain too
    u = site.gpuguard("undrain", "node1")
    assert u.returncode == 1 and "needs a GPU reset and none was seen" in u.stdout + u.stderr, (u.stdout, u.stderr)
    run_hook(site, "healthcheck")
    assert drained(site) and "[standing reset]" in raw_reason(site)
    # the GPU is reset: the admin's undrain goes through and a job runs on node1
    reload_driver(site, "node1")
    u = site.gpuguard("undrain", "node1")
    assert u.returncode == 0 and "cleared: XID119 gpu.xid" in u.stdout, (u.stdout, u.stderr)
    job = site.cluster.sbatch(JOB, "-w", "node1")
    info = site.cluster.wait_job(job, timeout=30)
    assert info["JobState"] == "COMPLETED" and ran(site, job), info


# --------------------------------------------------------------------------- 2. Slurm's own "Prolog error" drain


@pytest.mark.slow(30)
def test_slurms_own_prolog_error_drain_is_taken_over_and_its_usual_resume_lets_no_job_on(site_factory, tmp_path):
    """A prolog judges a fresh Xid 48 while gpuguard cannot reach slurmctld (a failover): it refuses the job and
    keeps a pending drain; slurmctld drains the node itself, "Prolog error". The next hook puts gpuguard's reason
    in its place; the usual resume of a "Prolog error" node is drained again and no job runs on the DBE GPU."""
    site = site_factory(nodes=2, config=FAST)
    assert run_hook(site, "healthcheck").returncode == 0
    down = tmp_path / "scontrol-unreachable"
    down.write_text("#!/bin/sh\necho 'slurm_load_node error: Unable to contact slurm controller' >&2\nexit 1\n")
    down.chmod(0o755)
    site.write_config({**FAST, "slurm": {"scontrol": str(down)}})
    add_kernel_lines(site, "node1", XID48)
    job = site.cluster.sbatch(JOB, "-w", "node1", "--requeue")
    site.cluster.wait_nodes(lambda f: "DRAIN" in f, nodes=["node1"], timeout=30)
    wait_for(lambda: raw_reason(site).startswith("Prolog error"), 10, "slurmctld's own Prolog error drain")
    no_job_ran(site, job, settle=0.5)
    site.write_config(FAST)  # slurmctld reachable again
    run_hook(site, "healthcheck")
    r = reason(site)
    assert r is not None and (r.check_id, r.keyword) == ("gpu.xid", "XID48"), raw_reason(site)
    assert [line for line in site.log_lines("healthcheck node=node1") if "slurm=replaced" in line]
    site.cluster.resume("node1")  # what admins do with a "Prolog error" node
    job = site.cluster.sbatch(JOB, "-w", "node1", "--requeue")
    site.cluster.wait_nodes(lambda f: "DRAIN" in f, nodes=["node1"], timeout=30)
    assert "[standing reset]" in raw_reason(site) and "XID48" in raw_reason(site)
    no_job_ran(site, job)


# --------------------------------------------------------------------------- 3. two hooks at once


@pytest.mark.slow(15)
def test_hooks_in_the_same_second_all_see_the_fault(site_factory):
    """Three prologs and the health check start together right after an Xid 119: the node lock serialises them,
    and every prolog after the first sees the condition the first one wrote: all refuse."""
    site = site_factory(nodes=2, config=FAST)
    assert run_hook(site, "healthcheck").returncode == 0
    add_kernel_lines(site, "node1", XID119)
    procs = [start_hook(site, "prolog", job=str(j)) for j in (901, 902, 903)] + [start_hook(site, "healthcheck")]
    outs = [(p.wait(90), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in outs[:3]] == [1, 1, 1], outs
    refused = [line for line in site.log_lines("prolog node=node1 job=90") if "verdict=" in line]
    assert len(refused) == 3 and all("verdict=drain" in x or "verdict=refused" in x for x in refused), refused
    assert drained(site) and reason(site).keyword == "XID119"


@pytest.mark.slow(20)
def test_two_real_jobs_allocated_together_on_a_faulty_node_both_refused(site_factory):
    """Two one-GPU jobs land on node1 in the same scheduler pass, an Xid 119 logged just before: neither runs."""
    site = site_factory(nodes=2, config=FAST)
    assert run_hook(site, "healthcheck").returncode == 0
    add_kernel_lines(site, "node1", XID119)
    jobs = [site.cluster.sbatch(JOB, "-w", "node1", "-n1", "--gres=gpu:1", "--requeue") for _ in range(2)]
    site.cluster.wait_nodes(lambda f: "DRAIN" in f, nodes=["node1"], timeout=30)
    no_job_ran(site, *jobs, settle=3.0)
    assert reason(site).keyword == "XID119"


# --------------------------------------------------------------------------- 5. the watch daemon's first start


@pytest.mark.slow(20)
def test_the_watch_daemons_first_start_leaves_what_the_hooks_judged_and_an_admin_lifted(site_factory,
                                                                                       watch_factory):
    """The hooks drained for an Xid 119, the GPU was reset and an admin undrained: rolling out the watch daemon
    (its first start on this boot) does not drain the node again for that old Xid, and drains at once for a new
    one."""
    site = site_factory(nodes=2, config=FAST)
    drained_by_xid(site, "XID119")
    reload_driver(site, "node1")
    u = site.gpuguard("undrain", "node1")
    assert u.returncode == 0, (u.stdout, u.stderr)
    w = watch_factory(site)
    time.sleep(3)
    assert not drained(site), raw_reason(site)
    w.append_kernel(XID48)
    wait_for(lambda: drained(site), 10, "the watch daemon to drain for the new Xid 48")
    assert reason(site).keyword == "XID48"


# --------------------------------------------------------------------------- 12. the cost of a kept drain


@pytest.mark.slow(15)
def test_a_kept_drain_costs_one_single_node_read_per_health_check(site_factory, tmp_path):
    """A node gpuguard keeps drained (XID79 found, gpu.count failing too: the finding differs from the drain's
    check) asks slurmctld for that one node once per health check: never the whole node table, never sinfo."""
    calls = tmp_path / "calls"
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("scontrol", "sinfo"):
        real = subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True, text=True).stdout.strip()
        (tools / name).write_text(f"#!/bin/sh\necho \"{name} $*\" >> {calls}\nexec {real} \"$@\"\n")
        (tools / name).chmod(0o755)
    site = site_factory(nodes=2, config={**FAST, "slurm": {"scontrol": str(tools / "scontrol")}})
    assert run_hook(site, "healthcheck").returncode == 0
    site.set_scenario("node1", "xid79")
    run_hook(site, "healthcheck")
    assert drained(site) and reason(site).keyword == "XID79"
    calls.write_text("")
    for _ in range(3):
        run_hook(site, "healthcheck")
    seen = calls.read_text().splitlines()
    assert seen == ["scontrol show node node1 --oneliner"] * 3 or \
        (len(seen) == 3 and all(x.startswith("scontrol show node") and "node1" in x for x in seen)), seen
    assert drained(site)
