"""A real multi-node Slurm cluster on this one host, for the demo and the integration tests.

`DevCluster` boots, in a private directory, its own munge daemon (own key and socket; a system munge is never
touched), one `slurmctld` and N `slurmd` (one per fake node, all on this host, each on its own free TCP port) with
fake GPUs (character devices with NVIDIA's major number 195), lets tests drive it with the ordinary client commands,
and kills everything it started on the way out.

    with DevCluster(nodes=3, prolog="/usr/libexec/gpuguard/prolog") as cluster:
        job = cluster.sbatch("#!/bin/sh\\nsrun hostname\\n", "-N2", "--gres=gpu:8")
        assert cluster.wait_job(job)["JobState"] == "COMPLETED"

FACTS measured with this class (Debian slurm-wlm 22.05.8, munge 0.5.15, 2 cores, root, gVisor sandbox):

0. Munge: `AuthInfo=socket=<path>` is honoured by auth/munge and cred/munge in daemons and clients, so each cluster
   runs its own `munged --foreground --socket=... --key-file=...` (in the foreground it logs to stderr, not to
   --log-file). `AuthInfo=cred_expire=N` below 5 is rejected ("error: AuthInfo=cred_expire=4 invalid") and the
   default 120 s is used. cred_expire=5 still launches jobs after an 8 s prolog.
   Boot to "all nodes idle": ~0.1-0.15 s.

1. slurmd does NOT pass its own environment on. A variable given to slurmd (GPUGUARD_CONFIG=...) reaches neither
   Prolog, Epilog nor HealthCheckProgram; there is not even a PATH (a /bin/sh script falls back to the shell's
   default PATH). The Prolog (PrologFlags=Alloc, job with --gres=gpu:2) gets exactly:
       CUDA_VISIBLE_DEVICES=0,1  GPU_DEVICE_ORDINAL=0,1  ROCR_VISIBLE_DEVICES=0,1  ZE_AFFINITY_MASK=0,1
       SLURM_JOB_GPUS=0,1  SLURMD_NODENAME=node2  SLURM_CLUSTER_NAME=gpuguard-dev  SLURM_CONF=<dir>/etc/slurm.conf
       SLURM_JOBID=1  SLURM_JOB_ID=1  SLURM_JOB_CPUS_PER_NODE=1(x2)  SLURM_JOB_GID=0  SLURM_JOB_NUM_NODES=2
       SLURM_JOB_PARTITION=gpu  SLURM_JOB_RESTART_COUNT=0  SLURM_JOB_STDIN=/dev/null
       SLURM_JOB_STDOUT=<dir>/jobs/slurm-%j.out (unexpanded)  SLURM_JOB_UID=0  SLURM_JOB_USER=root
       SLURM_JOB_WORK_DIR=<dir>/jobs  SLURM_NODELIST=node[1-2]  SLURM_SCRIPT_CONTEXT=prolog_slurmd  SLURM_UID=0
       (+ PWD from the shell: slurmd's working directory)
   The Epilog gets the same plus SLURM_JOB_DERIVED_EC, SLURM_JOB_EXIT_CODE, SLURM_JOB_EXIT_CODE2 and
   SLURM_SCRIPT_CONTEXT=epilog_slurmd. No SLURM_JOB_EXCLUSIVE, not even for `sbatch --exclusive` (22.05).
   The GPU indices are the gres.conf order (physical); `--exclusive --gres=gpu:8` gives SLURM_JOB_GPUS=0,...,7.
   A job that requests no GPUs gets NEITHER SLURM_JOB_GPUS NOR CUDA_VISIBLE_DEVICES in its prolog.
   The HealthCheckProgram gets ONLY `SLURMD_NODENAME=node1` (+ PWD): no SLURM_CONF, no SLURM_SCRIPT_CONTEXT, no
   PATH, so a health check must find slurm.conf / its own config some other way (default paths or arguments).
   HealthCheckInterval=0 disables it completely (not even run at startup); with an interval > 0 it also runs once
   when slurmd starts, before the node registers.

2. `scontrol show node -o` (22.05) prints Reason LAST, followed by ` [user@time]`, nothing after it:
   idle:     NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.00
             AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:8 NodeAddr=127.0.0.1 NodeHostName=vm Port=39449
             Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1024 AllocMem=0
             FreeMem=23909 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A
             MCS_label=N/A Partitions=gpu  BootTime=2026-11-22T03:11:46 SlurmdStartTime=2026-11-22T03:22:11
             LastBusyTime=2026-11-22T03:22:16 CfgTRES=cpu=2,mem=1G,billing=2 AllocTRES= CapWatts=n/a
             CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
             (one line; note the double spaces and values with spaces, e.g. OS=)
   drained:  ... State=IDLE+DRAIN ... ExtSensorsTemp=n/s Reason=gpuguard: gpu.xid XID79: GPU 0000:3b:00 fell off
             the bus [prolog] a=b State=IDLE [root@2026-11-22T03:22:16]
             (the reason is printed verbatim: `[`, `:`, `=` and even ` State=` inside it are not escaped)
   maintenance reservation (Flags=MAINT, StartTime=now): the node line has NO reservation key and no Reason; the
             state flags appear only after ~5 s (slurmctld's background pass): State=IDLE+MAINTENANCE+RESERVED
             (a plain reservation: State=IDLE+RESERVED; sinfo shows "maint" / "resv"). Drained in maintenance:
             State=IDLE+DRAIN+MAINTENANCE+RESERVED ... Reason=admin: bad dimm [ticket 42] [root@2026-...]
   After `scontrol update State=RESUME` the node is IDLE+NOT_RESPONDING (sinfo "idle*") until slurmctld pings it:
   ~0.8 s from DRAIN, ~1.0 s from DOWN. `resume()` waits for that.
   `scontrol show job -o`: one line, keys in a fixed order, e.g. `JobId=3 JobName=job-sw0x1e1r.sh UserId=root(0)
   GroupId=root(0) ... JobState=COMPLETED Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 ...
   AllocNode:Sid=localhost:2942 ... NodeList=node[1-2] BatchHost=node1 NumNodes=2 ... TresPerNode=gres:gpu:2`
   (keys may contain `:` and `/`; values may contain `=` and `,`, e.g. TRES=cpu=2,node=2,billing=2).

3. Prolog exits 1 on node2 only, 2-node batch job, SchedulerParameters=nohold_on_prolog_fail, JobRequeue=1:
   slurmctld logs "error: Prolog launch failure, JobId=1", "error: validate_node_specs: Prolog or job env setup
   failure on node node2, draining the node", "Requeuing JobId=1". Within ~0.1 s of the prolog: node2
   State=IDLE+DRAIN Reason=Prolog error [root@...]; the job is JobState=PENDING Reason=BeginTime Restarts=1,
   NodeList/BatchHost empty. A reason the prolog set itself first (`scontrol update nodename=node2 state=drain
   reason=...` from inside the prolog: works, SLURM_CONF is in its env) is kept; Slurm does not overwrite it.
   The job becomes eligible again cred_expire+1 s after the requeue (EligibleTime), then starts at the next
   scheduler pass on the healthy nodes: final JobState=COMPLETED Reason=None Restarts=1 NodeList=node[1,3]
   BatchHost=node1 ExitCode=0:0, and SLURM_JOB_RESTART_COUNT=1 in the second prolog run.
   End to end (sbatch to COMPLETED): 6.9-7.0 s here (cred_expire=5, sched_interval=1, bf_interval=1; prolog
   failure and requeue happen ~1 s after sbatch, the restart ~6 s later); 12.1 s with cred_expire=10;
   ~150 s with Slurm's defaults (cred_expire 120 + waiting for the 60 s main / 30 s backfill loop).
   Without nohold_on_prolog_fail: PENDING Reason=launch_failed_requeued_held Priority=0 (held until an admin
   releases it). With JobRequeue=0 (and no --requeue), or with `sbatch --no-requeue`: JobState=CANCELLED at once
   ("Requeue of JobId=1 returned an error: Requested operation is presently disabled"). JobRequeue=0 with
   `sbatch --requeue` requeues as above. So requeue needs JobRequeue=1 (the default) or `--requeue`, and not
   `--no-requeue`; node2 is drained in every case.

4. sbatch of a trivial 2-node job (Prolog=/bin/true) to COMPLETED: 0.96-0.98 s (first job of a cluster ~1.2 s).
   The submit-time scheduling attempt does not place it; the backfill pass (bf_interval=1) starts it, after which
   the job itself takes ~30 ms. With Slurm's default intervals the first start took ~3 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

# Binaries a cluster needs; client commands are looked up on PATH like an admin would.
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("scontrol", "sinfo", "sbatch", "squeue", "scancel")

# Job states after which a job will not change by itself (COMPLETING is not one of them).
TERMINAL_JOB_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)

# Environment variable put into every daemon (and every client command, hence every job) so that teardown can
# find stragglers that left the daemons' process groups (slurmstepd, prologs, job tasks).
MARKER_VAR = "GPUGUARD_DEVCLUSTER_ID"

# Node state flags under which the scheduler will not use a node.
_UNUSABLE = frozenset({"DRAIN", "DOWN", "NOT_RESPONDING", "FAIL", "INVALID_REG", "INVAL", "UNKNOWN"})

# A Unix socket path must fit in sockaddr_un.sun_path (108 bytes); slurmstepd puts sockets in SlurmdSpoolDir.
_MAX_BASE_LEN = 60


class DevClusterError(RuntimeError):
    """The cluster did not boot or did not do what was asked; the message includes the daemons' log tails."""


# --------------------------------------------------------------------------------------------- parsing


# The parsers live with the Slurm client: gpuguard reads `scontrol show node -o` the same way in production.
from gpuguard.slurm.parse import node_state_flags, parse_job_line, parse_node_line, parse_node_lines  # noqa: E402
from devtools.devhost import DebianHostView  # noqa: E402


# --------------------------------------------------------------------------------------------- environment


def missing_requirements() -> list[str]:
    """Why a DevCluster cannot boot here (empty list = it can): not root, or binaries missing."""
    problems = []
    if os.geteuid() != 0:
        problems.append("needs root (slurmd runs prologs as root, mknod for fake GPUs)")
    for name in DAEMONS + CLIENTS:
        if _which(name) is None:
            problems.append(f"{name} not found (apt-get install slurm-wlm munge)")
    return problems


def _which(name: str) -> Optional[str]:
    # Debian installs the daemons in /usr/sbin, which a non-login PATH may lack.
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin:/usr/local/sbin"
    return shutil.which(name, path=path)


def free_tcp_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free now; all sockets stay bound until every port is picked, so no
    port is handed out twice."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _clean_environ() -> dict[str, str]:
    """This process's environment without SLURM_* (a pytest run inside a Slurm job must not leak its job into the
    dev cluster's commands)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    return env


# --------------------------------------------------------------------------------------------- the cluster


class DevCluster:
    """munged + slurmctld + `nodes` slurmd on this host, in a private directory. Use as a context manager."""

    def __init__(
        self,
        nodes: int = 3,
        gpus_per_node: int = 8,
        prolog: Optional[str] = None,
        epilog: Optional[str] = None,
        health_check: Optional[str] = None,
        health_check_interval: int = 0,
        prolog_flags: Optional[str] = "Alloc",
        extra_conf: Optional[Mapping[str, str]] = None,
        workdir: Optional[Path] = None,
        env: Optional[Mapping[str, str]] = None,
        cred_expire: int = 5,
        boot_timeout: float = 30.0,
        command_timeout: float = 20.0,
        keep_workdir: bool = False,
        host_view: Optional[DebianHostView] = None,
    ) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.node_names = [f"node{index}" for index in range(1, nodes + 1)]
        self.gpus_per_node = gpus_per_node
        self.prolog = prolog
        self.epilog = epilog
        self.health_check = health_check
        self.health_check_interval = health_check_interval
        self.prolog_flags = prolog_flags
        self.extra_conf = dict(extra_conf or {})
        self.daemon_env_extra = dict(env or {})
        if cred_expire < 5:
            raise ValueError("Slurm 22.05 rejects cred_expire < 5 (and silently uses 120)")
        self.cred_expire = cred_expire
        self.boot_timeout = boot_timeout
        self.command_timeout = command_timeout
        self.cluster_id = uuid.uuid4().hex[:12]
        # None: the daemons run on this host as it is, every node at 127.0.0.1 (the default). A DebianHostView:
        # they run in private namespaces laid out like a stock Debian node, each node at its own address.
        self.host_view = host_view
        self.hostname = host_view.hostname if host_view else socket.gethostname().split(".")[0]
        self._own_workdir = workdir is None
        self._keep_workdir = keep_workdir
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpuguard-devcluster-"))
        self.base = self.workdir  # replaced by a short alias when the workdir path is too long for sockets
        self._alias: Optional[Path] = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started = False
        self.ctld_port = 0
        self.node_ports: dict[str, int] = {}

    # ---------------------------------------------------------------- paths

    @property
    def conf_path(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    @property
    def jobs_dir(self) -> Path:
        return self.base / "jobs"

    def node_dir(self, node: str) -> Path:
        return self.base / node

    def gpu_device(self, node: str, index: int) -> Path:
        return self.node_dir(node) / "dev" / f"nvidia{index}"

    def logs(self) -> dict[str, Path]:
        """Log file of every daemon: {"munged": ..., "slurmctld": ..., "node1": ..., ...}."""
        # munged in the foreground logs to stderr, which _spawn captures.
        paths = {"munged": self.base / "munge" / "munged.stderr", "slurmctld": self.base / "ctld" / "slurmctld.log"}
        for node in self.node_names:
            paths[node] = self.node_dir(node) / "slurmd.log"
        return paths

    def log_tails(self, lines: int = 30) -> str:
        """The last `lines` lines of every daemon log and its captured stdout/stderr, for failure messages."""
        chunks = []
        for path in self.logs().values():
            for candidate in dict.fromkeys((path, path.with_suffix(".stderr"))):
                if candidate.exists():
                    tail = candidate.read_text(errors="replace").splitlines()[-lines:]
                    chunks.append(f"==> {candidate} <==\n" + "\n".join(tail))
        return "\n".join(chunks)

    def dump_logs(self, lines: int = 30) -> None:
        """Print the log tails to stderr (pytest shows it for a failed test)."""
        print(self.log_tails(lines), file=sys.stderr)

    # ---------------------------------------------------------------- environment for clients

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (scontrol, sbatch, ...) talking to this cluster."""
        env = _clean_environ()
        env["SLURM_CONF"] = str(self.conf_path)
        env[MARKER_VAR] = self.cluster_id
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as it must run to see this cluster (inside the host view's namespaces, if any)."""
        return self.host_view.wrap(argv) if self.host_view else list(argv)

    def node_addr(self, node: str) -> str:
        """The node's NodeAddr in slurm.conf."""
        if self.host_view is None:
            return "127.0.0.1"
        return self.host_view.node_addr(self.node_names.index(node) + 1)

    def _daemon_env(self) -> dict[str, str]:
        env = self.env
        env.update(self.daemon_env_extra)
        return env

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "DevCluster":
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Keep a temp dir after a failure so its logs can be read.
        self.stop(keep_workdir=self._keep_workdir or exc_type is not None)

    def start(self) -> "DevCluster":
        if self._started:
            raise DevClusterError("cluster already started")
        self._started = True
        try:
            self._prepare_dirs()
            self._write_configs()
            if self.host_view is not None:
                self.host_view.start(self.base / "etc", len(self.node_names), self.env)
            self._start_munged()
            self._start_slurmctld()
            for node in self.node_names:
                self._start_slurmd(node)
            # registered and answering; a node the HealthCheckProgram drained at start counts as booted
            self.wait_nodes(lambda flags: "IDLE" in flags and not flags & (_UNUSABLE - {"DRAIN"}),
                            timeout=self.boot_timeout)
        except BaseException:
            self.stop(keep_workdir=True)
            raise
        return self

    def stop(self, keep_workdir: Optional[bool] = None) -> None:
        """Kill every daemon and everything they spawned; safe to call twice and after a failed start."""
        try:
            for name in reversed(list(self._procs)):  # slurmd first, munged last
                _terminate_group(self._procs[name])
            self._procs.clear()
            self._kill_stragglers()
        finally:
            if self.host_view is not None:
                self.host_view.stop()
            if self._alias is not None and self._alias.is_symlink():
                self._alias.unlink()
            keep = self._keep_workdir if keep_workdir is None else keep_workdir
            if self._own_workdir and not keep:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def stray_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of live processes that belong to this cluster: those carrying our marker variable
        (daemons, slurmstepd, prologs, jobs) and their descendants (a job run with --export=NONE loses the
        marker). Empty after `stop()`."""
        return _cluster_processes(self.cluster_id)

    def _kill_stragglers(self, timeout: float = 5.0) -> None:
        """slurmstepd calls setsid() and is reparented to init, so killing the daemons' process groups misses it
        and the jobs under it: freeze everything that is ours (so nothing forks or escapes meanwhile), then kill."""
        deadline = time.monotonic() + timeout
        while True:
            strays = self.stray_processes()
            if not strays:
                return
            if time.monotonic() > deadline:
                raise DevClusterError(f"processes survived teardown: {strays}")
            frozen: set[int] = set()
            while True:
                new = {pid for pid, _ in self.stray_processes()} - frozen
                if not new:
                    break
                for pid in new:
                    _kill_quietly(pid, signal.SIGSTOP)
                frozen |= new
            for pid in frozen:
                _kill_quietly(pid, signal.SIGKILL)
            time.sleep(0.05)

    # ---------------------------------------------------------------- setup

    def _prepare_dirs(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory others can write to; others must reach the socket (jobs as users).
        self.workdir.chmod(0o755)
        if len(str(self.workdir)) > _MAX_BASE_LEN:
            self._alias = Path(tempfile.mkdtemp(prefix="ggdc-"))
            self._alias.rmdir()
            self._alias.symlink_to(self.workdir)
            self.base = self._alias
        for sub in ("etc", "munge", "ctld/state", "jobs"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        (self.base / "munge").chmod(0o755)
        self.jobs_dir.chmod(0o1777)  # jobs may run as other users, like /tmp
        for node in self.node_names:
            (self.node_dir(node) / "spool").mkdir(parents=True, exist_ok=True)
            (self.node_dir(node) / "dev").mkdir(exist_ok=True)
            for index in range(self.gpus_per_node):
                self._make_gpu_device(self.gpu_device(node, index), index)

    @staticmethod
    def _make_gpu_device(path: Path, index: int) -> None:
        # Major 195 is NVIDIA's; Slurm reads the device numbers for cgroup confinement (not used here), and the
        # numbering makes SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES come out as on a real node.
        if not path.exists():
            os.mknod(path, 0o666 | 0o020000, os.makedev(195, index))

    def _write_configs(self) -> None:
        ports = free_tcp_ports(1 + len(self.node_names))
        self.ctld_port, node_ports = ports[0], ports[1:]
        self.node_ports = dict(zip(self.node_names, node_ports))
        (self.base / "etc" / "plugstack.conf").write_text("")  # isolate from the host's SPANK plugins
        self.conf_path.write_text(self.render_slurm_conf())
        (self.base / "etc" / "gres.conf").write_text(self.render_gres_conf())
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)

    def render_slurm_conf(self) -> str:
        base = self.base
        settings: dict[str, str] = {
            "ClusterName": "gpuguard-dev",
            "SlurmctldHost": f"{self.hostname}(127.0.0.1)",
            "SlurmctldPort": str(self.ctld_port),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            # Our own munged. cred_expire also delays the restart of a requeued job (Slurm waits it out before
            # the job is eligible again); 5 is the smallest value 22.05 accepts.
            "AuthInfo": f"socket={self.munge_socket},cred_expire={self.cred_expire}",
            "StateSaveLocation": f"{base}/ctld/state",
            "SlurmctldPidFile": f"{base}/ctld/slurmctld.pid",
            "SlurmctldLogFile": f"{base}/ctld/slurmctld.log",
            "SlurmdSpoolDir": f"{base}/%n/spool",
            "SlurmdPidFile": f"{base}/%n/slurmd.pid",
            "SlurmdLogFile": f"{base}/%n/slurmd.log",
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
            "PlugStackConfig": f"{base}/etc/plugstack.conf",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "GresTypes": "gpu",
            "SlurmdParameters": "config_overrides",
            "MpiDefault": "none",
            "SwitchType": "switch/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "MailProg": "/bin/true",
            "ReturnToService": "2",
            "JobRequeue": "1",
            # Requeued jobs must come back without an admin; a short main loop makes them come back quickly.
            "SchedulerParameters": "nohold_on_prolog_fail,sched_interval=1,bf_interval=1",
            "SlurmdTimeout": "10",
            "MessageTimeout": "5",
            "KillWait": "2",
            "InactiveLimit": "0",
            "MinJobAge": "600",
            "BatchStartTimeout": "10",
        }
        if self.prolog:
            settings["Prolog"] = self.prolog
        if self.epilog:
            settings["Epilog"] = self.epilog
        if self.prolog_flags:
            settings["PrologFlags"] = self.prolog_flags
        if self.health_check:
            settings["HealthCheckProgram"] = self.health_check
            settings["HealthCheckInterval"] = str(self.health_check_interval)
        settings.update(self.extra_conf)
        lines = [f"{key}={value}" for key, value in settings.items()]
        cpus = os.cpu_count() or 1
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        for node in self.node_names:
            lines.append(
                f"NodeName={node} NodeHostname={self.hostname} NodeAddr={self.node_addr(node)} "
                f"Port={self.node_ports[node]} "
                f"CPUs={cpus} RealMemory=1024{gres} State=UNKNOWN"
            )
        lines.append("PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def render_gres_conf(self) -> str:
        if self.gpus_per_node == 0:
            return ""
        last = self.gpus_per_node - 1
        return "".join(
            f"NodeName={node} Name=gpu File={self.node_dir(node)}/dev/nvidia[0-{last}]\n"
            for node in self.node_names
        )

    # ---------------------------------------------------------------- daemons

    def _spawn(self, name: str, argv: list[str], log_stem: Path) -> subprocess.Popen[bytes]:
        """Start a daemon in the foreground of its own session (so its whole process group can be killed)."""
        with open(log_stem.with_suffix(".stderr"), "ab") as stderr:
            proc = subprocess.Popen(
                self.command(argv),
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                env=self._daemon_env(),
                cwd=str(self.base),
                start_new_session=True,
            )
        self._procs[name] = proc
        return proc

    def _start_munged(self) -> None:
        munge = self.base / "munge"
        self._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",  # a reused workdir may hold the stale socket of a killed run; munged would refuse it
                f"--socket={self.munge_socket}",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
            munge / "munged.log",
        )
        self._wait_for(lambda: self.munge_socket.exists(), "munged socket", timeout=10)

    def _start_slurmctld(self) -> None:
        self._spawn(
            "slurmctld",
            [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf_path)],
            self.base / "ctld" / "slurmctld.log",
        )
        self._wait_for(
            lambda: self.run(["scontrol", "ping"], timeout=5).returncode == 0,
            "slurmctld to answer `scontrol ping`",
            timeout=self.boot_timeout,
        )

    # ---------------------------------------------------------------- controller faults (gpuguard's own surroundings)

    def stop_controller(self) -> None:
        """slurmctld goes away (a restart or a failover in progress): clients get 'Unable to contact'."""
        proc = self._procs.pop("slurmctld", None)
        if proc is not None:
            _terminate_group(proc)

    def start_controller(self) -> None:
        """slurmctld back, recovering its saved state (drains included), answering `scontrol ping`."""
        if "slurmctld" not in self._procs:
            self._start_slurmctld()

    def pause_controller(self) -> None:
        """slurmctld hangs (SIGSTOP): it accepts connections but never answers, so clients wait to their timeout."""
        _killpg_quietly(self._procs["slurmctld"].pid, signal.SIGSTOP)

    def resume_controller(self) -> None:
        _killpg_quietly(self._procs["slurmctld"].pid, signal.SIGCONT)
        self._wait_for(lambda: self.run(["scontrol", "ping"], timeout=5).returncode == 0,
                       "slurmctld to answer again after SIGCONT", timeout=self.boot_timeout)

    def _start_slurmd(self, node: str) -> None:
        self._spawn(
            node,
            [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf_path)],
            self.node_dir(node) / "slurmd.log",
        )

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise DevClusterError(f"{name} exited with {proc.returncode}\n{self.log_tails()}")

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        """Poll `ready()` with a short, growing interval until true; fail fast if a daemon died."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while not _ready_within(ready):
            self._check_alive()
            if time.monotonic() > deadline:
                raise DevClusterError(f"timed out after {timeout}s waiting for {what}\n{self.log_tails()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    # ---------------------------------------------------------------- client commands

    def run(self, cmd: Sequence[str], timeout: Optional[float] = None, check: bool = False,
            input: Optional[str] = None) -> subprocess.CompletedProcess[str]:
        """Run a client command against this cluster (its SLURM_CONF, our munge socket via slurm.conf)."""
        return subprocess.run(
            self.command(cmd),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout or self.command_timeout,
            check=check,
            input=input,
        )

    def _run_ok(self, cmd: Sequence[str]) -> str:
        result = self.run(cmd)
        if result.returncode != 0:
            raise DevClusterError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def sbatch(self, script_text: str, *args: str) -> str:
        """Submit `script_text` as a batch script (options in `args`, before the script); returns the job id.
        Output goes to `jobs/slurm-<id>.out` unless `args` says otherwise."""
        script = Path(tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.jobs_dir)[1])
        script.write_text(script_text if script_text.startswith("#!") else "#!/bin/sh\n" + script_text)
        script.chmod(0o755)
        out = self._run_ok(
            ["sbatch", "--parsable", f"--chdir={self.jobs_dir}", f"--output={self.jobs_dir}/slurm-%j.out", *args,
             str(script)]
        )
        return out.strip().split(";")[0]

    def job_output(self, job_id: str) -> str:
        return (self.jobs_dir / f"slurm-{job_id}.out").read_text()

    def job_info(self, job_id: str) -> dict[str, str]:
        return parse_job_line(self._run_ok(["scontrol", "show", "job", "-o", str(job_id)]))

    def wait_job(
        self, job_id: str, states: Iterable[str] = TERMINAL_JOB_STATES, timeout: float = 30.0
    ) -> dict[str, str]:
        """Poll until the job's JobState is one of `states`; returns its fields. Raises with logs on timeout."""
        wanted = set(states)
        info: dict[str, str] = {}

        def reached() -> bool:
            nonlocal info
            info = self.job_info(job_id)
            return info.get("JobState") in wanted

        try:
            self._wait_for(reached, f"job {job_id} to reach {sorted(wanted)}", timeout)
        except DevClusterError as error:
            raise DevClusterError(f"{error}\nlast job state: {info}") from None
        return info

    def node_info(self, name: str) -> dict[str, str]:
        return parse_node_line(self._run_ok(["scontrol", "show", "node", "-o", name]))

    def nodes_info(self) -> dict[str, dict[str, str]]:
        return parse_node_lines(self._run_ok(["scontrol", "show", "node", "-o"]))

    def node_flags(self, name: str) -> set[str]:
        return node_state_flags(self.node_info(name).get("State", ""))

    def wait_nodes(
        self, predicate: Callable[[set[str]], bool], nodes: Optional[Iterable[str]] = None, timeout: float = 30.0
    ) -> None:
        """Wait until `predicate(state flags)` holds for every node (default: all nodes)."""
        names = list(nodes or self.node_names)

        def reached() -> bool:
            result = self.run(["scontrol", "show", "node", "-o"], timeout=5)
            if result.returncode != 0:
                return False
            infos = parse_node_lines(result.stdout)
            states = {name: node_state_flags(info.get("State", "")) for name, info in infos.items()}
            return all(name in states and predicate(states[name]) for name in names)

        self._wait_for(reached, f"nodes {names} to reach the wanted state", timeout)

    def drain(self, node: str, reason: str) -> None:
        # The reason travels as one argv element: no shell, so spaces, `=` and `:` need no quoting.
        self._run_ok(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, node: str, wait: bool = True, timeout: float = 15.0) -> None:
        """Undrain `node`. Right after RESUME slurmctld shows it IDLE+NOT_RESPONDING (not schedulable) until it
        has pinged slurmd (~1 s); with `wait`, return only once it is usable again."""
        self._run_ok(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        if wait:
            self.wait_nodes(lambda flags: not flags & _UNUSABLE, nodes=[node], timeout=timeout)


def _ready_within(ready: Callable[[], bool]) -> bool:
    # A client command that hangs (slurmctld busy or still starting) counts as "not yet", not as an error.
    try:
        return ready()
    except subprocess.TimeoutExpired:
        return False


# --------------------------------------------------------------------------------------------- processes


def _terminate_group(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    """SIGTERM the process group (the daemon and what it forked without a new session), then SIGKILL."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    if proc.poll() is None:
        _killpg_quietly(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _killpg_quietly(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def _killpg_quietly(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _cluster_processes(cluster_id: str) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose environment carries `MARKER_VAR=cluster_id`, plus their descendants."""
    marker = f"{MARKER_VAR}={cluster_id}".encode()
    own = os.getpid()
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    marked: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        pid = int(entry.name)
        try:
            state, ppid = _state_and_parent(entry)
            if state in "ZX":
                continue
            cmdlines[pid] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            environ = (entry / "environ").read_bytes()
        except (OSError, ValueError):
            continue  # gone meanwhile, or a kernel thread
        parents[pid] = ppid
        if marker in environ.split(b"\0"):
            marked.add(pid)
    ours = set(marked)
    grew = True
    while grew:
        children = {pid for pid, ppid in parents.items() if ppid in ours} - ours
        ours |= children
        grew = bool(children)
    return sorted((pid, cmdlines[pid]) for pid in ours)


def _state_and_parent(proc_dir: Path) -> tuple[str, int]:
    # The command name in /proc/PID/stat may contain spaces and parentheses; fields follow the last ")".
    stat = (proc_dir / "stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])
