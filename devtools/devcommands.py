"""The client commands a test drives the dev cluster with (sbatch, scontrol show/update), and waiting on what
they report, parsed the way gpuguard parses it in production (gpuguard.slurm.parse)."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol, Sequence

from devtools.devenv import TERMINAL_JOB_STATES, UNUSABLE, DevClusterError
from devtools.devlayout import NodePlacement
from gpuguard.slurm.parse import node_state_flags, parse_job_line, parse_node_line, parse_node_lines


class WaitFor(Protocol):
    """Poll `ready()` until true; raise DevClusterError (with the daemons' logs) after `timeout` or once a daemon
    died (`devtools.devdaemons.SlurmDaemons.wait_for`)."""

    def __call__(self, ready: Callable[[], bool], what: str, timeout: float) -> None: ...


@dataclass
class SlurmCommands:
    """The client commands of one dev cluster: run where `placement` says, in the environment `environ()` gives (its
    SLURM_CONF and marker, read afresh for every command), jobs written to `jobs_dir`, waits through `wait_for`."""

    placement: NodePlacement
    environ: Callable[[], dict[str, str]]
    jobs_dir: Path
    wait_for: WaitFor
    command_timeout: float = 20.0

    @property
    def node_names(self) -> tuple[str, ...]:
        return self.placement.node_names

    # ---------------------------------------------------------------- client commands

    def run(self, cmd: Sequence[str], timeout: Optional[float] = None, check: bool = False,
            input: Optional[str] = None) -> subprocess.CompletedProcess[str]:
        """Run a client command against this cluster (its SLURM_CONF, our munge socket via slurm.conf)."""
        return subprocess.run(
            self.placement.command(cmd),
            env=self.environ(),
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
            self.wait_for(reached, f"job {job_id} to reach {sorted(wanted)}", timeout)
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

        self.wait_for(reached, f"nodes {names} to reach the wanted state", timeout)

    def drain(self, node: str, reason: str) -> None:
        # The reason travels as one argv element: no shell, so spaces, `=` and `:` need no quoting.
        self._run_ok(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, node: str, wait: bool = True, timeout: float = 15.0) -> None:
        """Undrain `node`. Right after RESUME slurmctld shows it IDLE+NOT_RESPONDING (not schedulable) until it
        has pinged slurmd (~1 s); with `wait`, return only once it is usable again."""
        self._run_ok(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        if wait:
            self.wait_nodes(lambda flags: not flags & UNUSABLE, nodes=[node], timeout=timeout)
