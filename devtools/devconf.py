"""The dev cluster's configuration files: slurm.conf (its own munge socket, ports, fast scheduling so a requeued
job comes back in seconds), gres.conf (the fake GPUs), the munge key."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from devtools.devenv import free_tcp_ports
from devtools.devlayout import ClusterPaths, NodePlacement


@dataclass
class SlurmConfFiles:
    """slurm.conf, gres.conf and the munge key of one dev cluster, from what it is given here: its paths, where its
    nodes run, its hooks and settings. `write()` picks the free ports (`ctld_port`, `node_ports`)."""

    paths: ClusterPaths
    placement: NodePlacement
    gpus_per_node: int = 8
    cred_expire: int = 5
    prolog: Optional[str] = None
    epilog: Optional[str] = None
    prolog_flags: Optional[str] = "Alloc"
    health_check: Optional[str] = None
    health_check_interval: int = 0
    extra_conf: dict[str, str] = field(default_factory=dict)
    ctld_port: int = 0
    node_ports: dict[str, int] = field(default_factory=dict)
    # leaf switch -> its nodes (a hostlist); empty: no topology.conf, topology/none
    topology: dict[str, str] = field(default_factory=dict)

    @property
    def node_names(self) -> tuple[str, ...]:
        return self.paths.node_names

    def write(self) -> None:
        ports = free_tcp_ports(1 + len(self.node_names))
        self.ctld_port, node_ports = ports[0], ports[1:]
        self.node_ports = dict(zip(self.node_names, node_ports))
        (self.paths.etc / "plugstack.conf").write_text("")  # isolate from the host's SPANK plugins
        self.paths.conf_path.write_text(self.render_slurm_conf())
        (self.paths.etc / "gres.conf").write_text(self.render_gres_conf())
        if self.topology:
            (self.paths.etc / "topology.conf").write_text(self.render_topology_conf())
        key = self.paths.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)

    def render_slurm_conf(self) -> str:
        settings = self._base_settings()
        settings.update(self._hook_settings())
        if self.topology:
            settings["TopologyPlugin"] = "topology/tree"
        settings.update(self.extra_conf)
        lines = [f"{key}={value}" for key, value in settings.items()]
        lines += self._node_lines()
        lines.append("PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def render_topology_conf(self) -> str:
        """topology.conf beside slurm.conf: one leaf switch per line, and a spine joining them (topology/tree wants
        one fabric)."""
        lines = [f"SwitchName={name} Nodes={nodes}" for name, nodes in self.topology.items()]
        lines.append(f"SwitchName=spine Switches={','.join(self.topology)}")
        return "\n".join(lines) + "\n"

    def _base_settings(self) -> dict[str, str]:
        """Everything but the hooks: our own munged, state and logs under the workdir, no accounting, fast
        scheduling so a requeued job comes back in seconds."""
        base = self.paths.base
        return {
            "ClusterName": "gpuguard-dev",
            "SlurmctldHost": f"{self.placement.hostname}({self.placement.controller_addr})",
            "SlurmctldPort": str(self.ctld_port),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            # Our own munged. cred_expire also delays the restart of a requeued job (Slurm waits it out before
            # the job is eligible again); 5 is the smallest value 22.05 accepts.
            "AuthInfo": f"socket={self.paths.munge_socket},cred_expire={self.cred_expire}",
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

    def _hook_settings(self) -> dict[str, str]:
        settings: dict[str, str] = {}
        if self.prolog:
            settings["Prolog"] = self.prolog
        if self.epilog:
            settings["Epilog"] = self.epilog
        if self.prolog_flags:
            settings["PrologFlags"] = self.prolog_flags
        if self.health_check:
            settings["HealthCheckProgram"] = self.health_check
            settings["HealthCheckInterval"] = str(self.health_check_interval)
        return settings

    def _node_lines(self) -> list[str]:
        cpus = os.cpu_count() or 1
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        place = self.placement
        return [f"NodeName={node} NodeHostname={place.node_hostname(node)} NodeAddr={place.node_addr(node)} "
                f"Port={self.node_ports[node]} "
                f"CPUs={cpus} RealMemory=1024{gres} State=UNKNOWN" for node in self.node_names]

    def render_gres_conf(self) -> str:
        if self.gpus_per_node == 0:
            return ""
        last = self.gpus_per_node - 1
        return "".join(
            f"NodeName={node} Name=gpu File={self.paths.node_dir(node)}/dev/nvidia[0-{last}]\n"
            for node in self.node_names
        )
