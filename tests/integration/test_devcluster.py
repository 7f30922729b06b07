"""DevCluster: a real munge + slurmctld + 3 slurmd cluster on this host, and the Slurm behaviour gpuguard relies on.

The parser tests at the top run anywhere (recorded `scontrol` lines from Slurm 22.05.8); the rest boot a cluster
and need root, slurm-wlm and munge.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from devtools.devcluster import DevCluster, missing_requirements
from gpuguard.slurm.parse import node_state_flags, parse_job_line, parse_node_line

_MISSING = missing_requirements()
needs_cluster = pytest.mark.skipif(bool(_MISSING), reason="DevCluster cannot boot here: " + "; ".join(_MISSING))

# ------------------------------------------------------------------------------------ parsers (recorded output)

IDLE_NODE = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.00 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:8 NodeAddr=127.0.0.1 NodeHostName=vm Port=39449 "
    "Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1024 AllocMem=0 FreeMem=23909 "
    "Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu  "
    "BootTime=2026-11-22T03:11:46 SlurmdStartTime=2026-11-22T03:22:11 LastBusyTime=2026-11-22T03:22:16 "
    "CfgTRES=cpu=2,mem=1G,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s "
    "ExtSensorsWatts=0 ExtSensorsTemp=n/s \n"
)
TRICKY_REASON = "gpuguard: XID79 gpu.xid: GPU 0000:3b:00 fell off the bus [prolog] a=b State=IDLE"
DRAINED_NODE = (
    IDLE_NODE.rstrip().replace("NodeName=node1", "NodeName=node2").replace("State=IDLE", "State=IDLE+DRAIN")
    + f" Reason={TRICKY_REASON} [root@2026-11-22T03:22:16]\n"
)
MAINT_DRAINED_NODE = (
    IDLE_NODE.rstrip().replace("State=IDLE", "State=IDLE+DRAIN+MAINTENANCE+RESERVED")
    + " Reason=admin: bad dimm [ticket 42] [root@2026-11-22T03:23:51]"
)
JOB = (
    "JobId=1 JobName=job-f9312y6y.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=COMPLETED Reason=None Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-11-22T03:24:04 "
    "EligibleTime=2026-11-22T03:24:15 AccrueTime=2026-11-22T03:24:15 StartTime=2026-11-22T03:24:15 "
    "EndTime=2026-11-22T03:24:15 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-22T03:24:15 "
    "Scheduler=Main Partition=gpu AllocNode:Sid=localhost:2942 ReqNodeList=(null) ExcNodeList=(null) "
    "NodeList=node[1,3] BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 "
    "MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) "
    "Network=(null) Command=/tmp/gpuguard-devcluster-v9ujl24y/jobs/job-f9312y6y.sh "
    "WorkDir=/tmp/gpuguard-devcluster-v9ujl24y/jobs StdErr=/tmp/gpuguard-devcluster-v9ujl24y/jobs/slurm-1.out "
    "StdIn=/dev/null StdOut=/tmp/gpuguard-devcluster-v9ujl24y/jobs/slurm-1.out Power= TresPerNode=gres:gpu:1 \n"
)


def test_parse_idle_node_keeps_values_with_spaces() -> None:
    node = parse_node_line(IDLE_NODE)
    assert node["NodeName"] == "node1"
    assert node["State"] == "IDLE"
    assert node["OS"] == "Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0"
    assert node["CfgTRES"] == "cpu=2,mem=1G,billing=2"
    assert node["AllocTRES"] == ""
    assert node["ExtSensorsTemp"] == "n/s"
    assert "Reason" not in node


def test_parse_drained_node_reason_with_brackets_colons_and_keys() -> None:
    node = parse_node_line(DRAINED_NODE)
    assert node["Reason"] == TRICKY_REASON
    assert (node["ReasonUser"], node["ReasonTime"]) == ("root", "2026-11-22T03:22:16")
    # ` State=IDLE` inside the reason must not overwrite the real state.
    assert node["State"] == "IDLE+DRAIN"
    assert node_state_flags(node["State"]) == {"IDLE", "DRAIN"}


def test_parse_node_in_maintenance_and_fields_after_the_stamp() -> None:
    node = parse_node_line(MAINT_DRAINED_NODE + " Comment=rack 7, slot [3]")
    assert node["Reason"] == "admin: bad dimm [ticket 42]"
    assert node_state_flags(node["State"]) == {"IDLE", "DRAIN", "MAINTENANCE", "RESERVED"}
    assert node["Comment"] == "rack 7, slot [3]"


def test_node_state_flags_not_responding() -> None:
    assert node_state_flags("IDLE*") == {"IDLE", "NOT_RESPONDING"}
    assert node_state_flags("IDLE+NOT_RESPONDING") == {"IDLE", "NOT_RESPONDING"}


def test_parse_job_line() -> None:
    job = parse_job_line(JOB)
    assert (job["JobId"], job["JobState"], job["Reason"], job["Restarts"]) == ("1", "COMPLETED", "None", "1")
    assert (job["NodeList"], job["BatchHost"]) == ("node[1,3]", "node1")
    assert job["AllocNode:Sid"] == "localhost:2942"
    assert job["ReqB:S:C:T"] == "0:0:*:*"
    assert job["TRES"] == "cpu=2,node=2,billing=2"
    assert job["Power"] == ""


def test_parse_job_name_with_spaces_and_fake_keys() -> None:
    job = parse_job_line(JOB.replace("JobName=job-f9312y6y.sh", "JobName=train run UserId=evil(7) JobState=X"))
    assert job["JobName"] == "train run UserId=evil(7) JobState=X"
    assert (job["UserId"], job["JobState"]) == ("root(0)", "COMPLETED")


# ------------------------------------------------------------------------------------ a live cluster

# Records its environment; fails on a node whose fail file exists, first draining it with the file's content as
# reason when there is one. slurmd gives prologs no PATH: /bin/sh's default PATH finds scontrol in /usr/bin.
PROLOG = """#!/bin/sh
ctl={ctl}
env | sort > "$ctl/env/prolog-$SLURMD_NODENAME-$SLURM_JOB_ID-$SLURM_JOB_RESTART_COUNT"
if [ -f "$ctl/fail-$SLURMD_NODENAME" ]; then
    reason=$(cat "$ctl/fail-$SLURMD_NODENAME")
    if [ -n "$reason" ]; then
        scontrol update nodename="$SLURMD_NODENAME" state=drain reason="$reason"
    fi
    exit 1
fi
exit 0
"""


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ctl = tmp_path_factory.mktemp("prologctl")
    (ctl / "env").mkdir()
    prolog = ctl / "prolog.sh"
    prolog.write_text(PROLOG.format(ctl=ctl))
    prolog.chmod(0o755)
    return ctl


@pytest.fixture(scope="module")
def shared_cluster(control_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    if _MISSING:
        pytest.skip("DevCluster cannot boot here: " + "; ".join(_MISSING))
    cluster = DevCluster(
        nodes=3,
        prolog=str(control_dir / "prolog.sh"),
        workdir=tmp_path_factory.mktemp("devcluster"),
        env={"GPUGUARD_CONFIG": "/etc/gpuguard/from-slurmd-env.yaml"},
    )
    with cluster:
        yield cluster
    assert cluster.stray_processes() == []


@pytest.fixture
def cluster(shared_cluster: DevCluster, control_dir: Path) -> Iterator[DevCluster]:
    """The module's cluster, put back to all-idle after each test (fail files removed, drained nodes resumed)."""
    yield shared_cluster
    for fail_file in control_dir.glob("fail-*"):
        fail_file.unlink()
    for name, info in shared_cluster.nodes_info().items():
        if "DRAIN" in node_state_flags(info.get("State", "")):
            shared_cluster.resume(name)


@pytest.mark.integration
@needs_cluster
def test_two_node_job_writes_its_nodelist(cluster: DevCluster) -> None:
    started = time.monotonic()
    job = cluster.sbatch('#!/bin/sh\necho "$SLURM_JOB_NODELIST" > nodelist-$SLURM_JOB_ID\n', "-N2")
    info = cluster.wait_job(job, timeout=30)
    elapsed = time.monotonic() - started
    assert info["JobState"] == "COMPLETED", cluster.log_tails()
    written = (cluster.jobs_dir / f"nodelist-{job}").read_text().strip()
    assert written == info["NodeList"]
    assert info["NumNodes"] == "2"
    print(f"2-node job: sbatch to COMPLETED in {elapsed:.2f} s on {written}")


@pytest.mark.integration
@needs_cluster
def test_prolog_env_has_job_gpus_but_not_slurmd_env(cluster: DevCluster, control_dir: Path) -> None:
    job = cluster.sbatch("#!/bin/sh\ntrue\n", "-N2", "--gres=gpu:2")
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    dumps = sorted((control_dir / "env").glob(f"prolog-*-{job}-0"))
    assert len(dumps) == 2, dumps
    for dump in dumps:
        env = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
        node = dump.name.split("-")[1]
        assert env["SLURMD_NODENAME"] == node
        assert env["SLURM_JOB_GPUS"] == "0,1"
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert env["SLURM_SCRIPT_CONTEXT"] == "prolog_slurmd"
        assert env["SLURM_JOB_RESTART_COUNT"] == "0"
        assert env["SLURM_CONF"] == str(cluster.conf_path)
        # slurmd does not hand its own environment to the prolog: config must come from a file, not env.
        assert "GPUGUARD_CONFIG" not in env
        assert "PATH" not in env


@pytest.mark.integration
@needs_cluster
def test_drain_and_resume_round_trip(cluster: DevCluster) -> None:
    reason = "gpuguard: ECC gpu.ecc: uncorrectable=3 State=IDLE on GPU 0000:3b:00 [health]"
    cluster.drain("node3", reason)
    info = cluster.node_info("node3")
    assert "DRAIN" in node_state_flags(info["State"])
    assert info["Reason"] == reason
    assert info["ReasonUser"] == "root"
    cluster.resume("node3")
    info = cluster.node_info("node3")
    assert node_state_flags(info["State"]) == {"IDLE"}
    assert "Reason" not in info


def _run_with_failing_prolog(cluster: DevCluster, control_dir: Path, node: str, reason: str) -> dict[str, str]:
    (control_dir / f"fail-{node}").write_text(reason)
    job = cluster.sbatch("#!/bin/sh\necho ran on $SLURM_JOB_NODELIST\n", "-N2")
    info = cluster.wait_job(job, timeout=40)
    assert info["JobState"] == "COMPLETED", cluster.log_tails()
    assert info["Restarts"] == "1"
    assert node not in info["NodeList"]
    assert cluster.job_output(job).strip() == f"ran on {info['NodeList']}"
    return info


@pytest.mark.integration
@needs_cluster
def test_prolog_failure_requeues_job_onto_healthy_nodes_keeping_our_reason(
    cluster: DevCluster, control_dir: Path
) -> None:
    reason = "gpuguard: XID79 gpu.xid: GPU 0000:3b:00 fell off the bus [prolog]"
    # The first allocation is node[1-2]; the retry must avoid node2.
    info = _run_with_failing_prolog(cluster, control_dir, "node2", reason)
    assert (info["NodeList"], info["BatchHost"]) == ("node[1,3]", "node1")
    node = cluster.node_info("node2")
    assert "DRAIN" in node_state_flags(node["State"])
    assert node["Reason"] == reason  # Slurm keeps the reason the prolog set; it does not write "Prolog error"


@pytest.mark.integration
@needs_cluster
def test_prolog_failure_without_reason_drains_with_prolog_error(cluster: DevCluster, control_dir: Path) -> None:
    # node1 is in every first allocation (Slurm picks the lowest-numbered free nodes).
    info = _run_with_failing_prolog(cluster, control_dir, "node1", "")
    assert (info["NodeList"], info["BatchHost"]) == ("node[2-3]", "node2")
    node = cluster.node_info("node1")
    assert "DRAIN" in node_state_flags(node["State"])
    assert node["Reason"] == "Prolog error"


def _count_sleeps(cluster: DevCluster) -> int:
    programs = [cmd.split()[0] for _, cmd in cluster.stray_processes() if cmd]
    return sum(program == "sleep" or program.endswith("/sleep") for program in programs)


@pytest.mark.integration
@needs_cluster
def test_teardown_kills_daemons_steps_and_jobs(tmp_path: Path) -> None:
    """A second cluster (alongside the module's one): stopping it mid-job leaves nothing of it running."""
    cluster = DevCluster(nodes=2, prolog="/bin/true", workdir=tmp_path / "c")
    with cluster:
        # A job step, and a background process that leaves the job's session: both must die too.
        job = cluster.sbatch("#!/bin/sh\nsrun sleep 300 &\nsetsid sleep 300 &\nsleep 300\n", "-N2")
        cluster.wait_job(job, states={"RUNNING"})
        deadline = time.monotonic() + 10
        while _count_sleeps(cluster) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)  # batch sleep + setsid sleep + one step task per node
        commands = [cmd for _, cmd in cluster.stray_processes()]
        assert any(cmd.startswith("slurmstepd") for cmd in commands), commands
        assert _count_sleeps(cluster) == 4, commands
    assert cluster.stray_processes() == []
    ps = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True, check=True).stdout
    survivors = [line for line in ps.splitlines() if str(tmp_path) in line and not line.startswith("Z")]
    assert survivors == []
