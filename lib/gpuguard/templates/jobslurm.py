"""The job's own scontrol calls (`gpuguard job-attempt`, as the job's user): bounded, argv lists, never a shell; a
failure is said on stderr and answered with nothing, never raised into the batch script."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from gpuguard.slurm.parse import node_state_flags, parse_job_line, parse_node_lines
from gpuguard.templates.attempts import NodeInfo
from gpuguard.templates.jobfiles import warn
from gpuguard.util.toolrun import run_tool


@dataclass
class Scontrol:
    """Bounded scontrol calls (argv lists, never a shell)."""
    binary: str = "scontrol"
    timeout_s: float = 10.0
    env: Optional[Mapping[str, str]] = None

    def run(self, args: Sequence[str]) -> Optional[str]:
        r = run_tool([self.binary, *args], self.timeout_s, env=self.env)
        if r.rc is None:
            warn(f"scontrol {' '.join(args)}: {r.error}")
            return None
        if r.rc != 0:
            warn(f"scontrol {' '.join(args)} failed ({r.rc}): {r.err_text().strip()[:300]}")
            return None
        return r.text()

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run(["show", "job", "-o", job_id])
        return parse_job_line(out) if out else {}

    def hostnames(self, nodelist: str) -> list[str]:
        if not nodelist or nodelist in ("(null)", "None"):
            return []
        out = self.run(["show", "hostnames", nodelist])
        return [h for h in (out or "").split() if h]

    def nodes(self, names: Sequence[str]) -> dict[str, NodeInfo]:
        if not names:
            return {}
        out = self.run(["show", "node", "-o", ",".join(names)])
        infos: dict[str, NodeInfo] = {}
        for name, f in parse_node_lines(out or "").items():
            reason = f.get("Reason")
            infos[name] = NodeInfo(name, frozenset(node_state_flags(f.get("State", ""))),
                                   None if reason in (None, "", "(null)", "None") else reason,
                                   boot_time=f.get("BootTime") or None, slurmd_start=f.get("SlurmdStartTime") or None)
        return infos

    def partition_nodes(self, partition: str) -> list[str]:
        if not partition or partition in ("(null)", "None"):
            return []
        out = self.run(["show", "partition", "-o", partition.split(",")[0]])
        fields = parse_job_line(out) if out else {}
        return self.hostnames(fields.get("Nodes", ""))

    def requeue(self, job_id: str) -> bool:
        return self.run(["requeue", job_id]) is not None

    def exclude(self, job_id: str, nodes: Sequence[str]) -> bool:
        return self.run(["update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"]) is not None
