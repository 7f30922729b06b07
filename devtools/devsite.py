"""A local gpuguard site: a real Slurm cluster (DevCluster) whose nodes run gpuguard's installed hooks over
simulated GPU nodes. Used by `make demo`, the integration tests and the benchmark, so all three exercise
exactly the files an admin installs (hooks + gpuguard.env + config.yaml)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from devtools.devcluster import DevCluster
from devtools.devhost import DebianHostView
from devtools.devnetns import NodeNetworks
from gpuguard.util.fs import atomic_write
from gpuguard.cli.install import install_hooks, repo_root
from gpuguard.store.sqlite import Store


def scenarios_dir() -> Path:
    root = repo_root()
    if root is None:
        raise FileNotFoundError("examples/scenarios not found: run from a gpuguard checkout")
    return root / "examples" / "scenarios"


def scenario_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    p = scenarios_dir() / (name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml")
    if not p.is_file():
        raise FileNotFoundError(f"no scenario {name_or_path!r} (looked for {p})")
    return p


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def start_agent(python: str, state_dir: Path, timeout_s: float = 30.0,
                env: Optional[dict[str, str]] = None, stderr: Any = None) -> subprocess.Popen[bytes]:
    """The node agent for hooks whose gpuguard.env names `state_dir`; returns once it listens. `env`: its
    environment (default this process's); `stderr`: where its log lines go (default this process's stderr)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([python, "-I", "-m", "gpuguard.agent.server", "--state-dir", str(state_dir),
                             "--exit-with-parent"], stdin=subprocess.DEVNULL, cwd="/", env=env, stderr=stderr)
    until = time.monotonic() + timeout_s
    while not agent_listening(state_dir / "agent.sock"):  # a stale socket file may be there already
        if proc.poll() is not None or time.monotonic() > until:
            stop_agent(proc)
            raise RuntimeError(f"the node agent did not start (exit {proc.returncode})")
        time.sleep(0.05)
    return proc


def agent_listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))  # the agent's child for this empty request just ends
            return True
        except OSError:
            return False


def stop_agent(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class DevSite:
    def __init__(self, nodes: int = 3, workdir: Optional[Path] = None, scenario: str = "healthy-p5",
                 config: Optional[Mapping[str, Any]] = None, prolog: bool = True, epilog: bool = False,
                 healthcheck: bool = False, health_check_interval: int = 0, keep: bool = False,
                 python: Optional[str] = None, slurm_conf: Optional[Mapping[str, str]] = None,
                 host_view: Optional[DebianHostView | NodeNetworks] = None, agent: Optional[bool] = None,
                 topology: Optional[Mapping[str, str]] = None) -> None:
        self._own = workdir is None
        self.keep = keep
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gg-site-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.libexec = self.workdir / "libexec"
        self.scenarios = self.workdir / "scenarios"
        self.scenarios.mkdir(exist_ok=True)
        self.config_path = self.workdir / "config.yaml"
        self.log_path = self.workdir / "gpuguard.log"
        self.python = python or sys.executable
        hooks = install_hooks(self.libexec, self.python, str(self.config_path), state_dir=str(self.workdir / "state"),
                              runtime_dir=str(self.workdir / "run"))
        self.cluster = DevCluster(
            nodes=nodes, workdir=self.workdir / "cluster",
            prolog=str(hooks["prolog"]) if prolog else None,
            epilog=str(hooks["epilog"]) if epilog else None,
            health_check=str(hooks["healthcheck"]) if healthcheck else None,
            health_check_interval=health_check_interval, extra_conf=slurm_conf, host_view=host_view,
            topology=topology)
        for node in self.cluster.node_names:
            self.set_scenario(node, scenario)
        self.config: dict[str, Any] = {}
        self.write_config(config or {})
        # the node agent the hooks ask first (gpuguard.agent), as `gpuguard watch --agent` keeps it on a node;
        # GPUGUARD_TEST_AGENT=1 runs every site's hooks through one (the suite must pass with and without)
        self.agent: Optional[subprocess.Popen[bytes]] = None
        if agent if agent is not None else os.environ.get("GPUGUARD_TEST_AGENT") == "1":
            self.agent = start_agent(self.python, self.workdir / "state")
            weakref.finalize(self, stop_agent, self.agent)

    # ------------------------------------------------------------------ configuration
    def base_config(self) -> dict[str, Any]:
        from gpuguard.simulate.build import build_fake_nvml

        return {
            "store": {"path": str(self.workdir / "state" / "{node}.db"), "runtime_dir": str(self.workdir / "run")},
            "simulation": {"scenario_dir": str(self.scenarios), "workdir": str(self.workdir / "sim"),
                           "fake_nvml": str(build_fake_nvml()), "tools": self.simulated_tools()},
            "logging": {"syslog": False, "file": str(self.log_path)},
            # the HealthCheckProgram gets no SLURM_CONF from slurmd
            "slurm": {"conf": str(self.cluster.workdir / "etc" / "slurm.conf")},
        }

    def simulated_tools(self) -> dict[str, str]:
        """nccl-tests and dcgmi for the simulated nodes' optional tier: stubs that read each node's scenario."""
        from devtools.nccl_tests_stub import install_stub

        bindir = str(self.workdir / "sim-tools")
        return {"all_reduce_perf": str(install_stub(bindir, str(self.scenarios))),
                "dcgmi": str(install_stub(bindir, str(self.scenarios), name="dcgmi", tool="dcgmi"))}

    def write_config(self, extra: Mapping[str, Any]) -> None:
        self.config = _merge(self.base_config(), extra)
        atomic_write(self.config_path, yaml.safe_dump(self.config, sort_keys=False))

    def set_scenario(self, node: str, scenario: str) -> Path:
        """Swap what `node`'s simulated hardware looks like (an example name or a path); takes effect at the
        next hook run, as a real fault would."""
        dest = self.scenarios / f"{node}.yaml"
        atomic_write(dest, scenario_path(scenario).read_bytes())
        return dest

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "DevSite":
        self.cluster.start()
        return self

    def stop(self) -> None:
        self.cluster.stop()
        if self.agent is not None:
            stop_agent(self.agent)
        if self._own and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "DevSite":
        return self.start()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.keep = True  # keep logs for a failed test / demo
            sys.stderr.write(f"(site kept for inspection: {self.workdir})\n")
        self.stop()

    # ------------------------------------------------------------------ observing
    def store(self, node: str) -> Store:
        return Store(str(self.workdir / "state" / f"{node}.db"))

    def runs(self, node: str, kind: Optional[str] = None) -> list[dict[str, Any]]:
        path = self.workdir / "state" / f"{node}.db"
        if not path.exists():
            return []
        with self.store(node) as st:
            runs = st.runs(node=node)
            for r in runs:
                r["findings"] = st.findings_for(r["id"])
        return [r for r in runs if kind is None or r["kind"] == kind]

    def log_lines(self, needle: str = "") -> list[str]:
        if not self.log_path.exists():
            return []
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if needle in line]

    def hook_env(self, node: str, kind: str = "prolog", **extra: str) -> dict[str, str]:
        """The bare environment slurmd gives a hook (verified on 22.05: never PATH; a prolog/epilog gets
        SLURM_CONF and the job's variables, a HealthCheckProgram only SLURMD_NODENAME)."""
        env = {"SLURMD_NODENAME": node}
        if kind != "healthcheck":
            env.update({"SLURM_CONF": str(self.cluster.conf_path), "SLURM_SCRIPT_CONTEXT": f"{kind}_slurmd"})
        env.update(extra)
        return env

    def run_hook(self, kind: str, node: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        """Run an installed hook the way slurmd does (e.g. for a node Slurm would not schedule on)."""
        script = self.libexec / f"gpuguard-{kind}"
        return subprocess.run(self.cluster.node_command(node, [str(script)]), env=self.hook_env(node, kind, **env),
                              capture_output=True, text=True, timeout=timeout, cwd="/")

    def write_scenario(self, node: str, base: str, **changes: Any) -> Path:
        """`node`'s scenario = an example scenario with top-level keys replaced (e.g. boot_id=... to simulate a
        reboot)."""
        data = yaml.safe_load(scenario_path(base).read_text()) or {}
        data.update(changes)
        dest = self.scenarios / f"{node}.yaml"
        atomic_write(dest, yaml.safe_dump(data, sort_keys=False))
        return dest

    def gpuguard(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "GPUGUARD_CONFIG": str(self.config_path), "GPUGUARD_STATE_DIR": str(self.workdir / "state"),
               "GPUGUARD_RUNTIME_DIR": str(self.workdir / "run"), **self.cluster.env}
        return subprocess.run(self.cluster.command([self.python, "-m", "gpuguard", *args]), env=env,
                              capture_output=True, text=True, timeout=timeout)
