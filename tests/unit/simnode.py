"""Shared by the unit tests that run whole gpuguard runs (`gpuguard.pipeline.run.execute`) against a simulated node: a config
on a temp dir, a scenario written on the fly, and an in-memory Slurm that takes drains (the SlurmClient seam)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import yaml

from gpuguard.config.schema import Config
from gpuguard.siteconfig import parse_config
from gpuguard.context import RunContext
from gpuguard.slurm.client import NodeState

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "examples" / "scenarios"


class MemorySlurm:
    """A node that is up, takes a drain and an undrain, and remembers what was done to it."""

    def __init__(self, reason: Optional[str] = None, states: frozenset[str] = frozenset({"IDLE"})) -> None:
        self.reason = reason
        self.states = states
        self.calls: list[tuple[str, Optional[str]]] = []

    def get_node(self, name: str) -> Optional[NodeState]:
        states = self.states | ({"DRAIN"} if self.reason else set())
        return NodeState(name=name, states=frozenset(states), reason=self.reason)

    def drain(self, name: str, reason: str) -> None:
        self.calls.append(("drain", reason))
        self.reason = reason

    def undrain(self, name: str) -> None:
        self.calls.append(("undrain", None))
        self.reason = None

    def set_reason(self, name: str, reason: str) -> None:
        self.calls.append(("set_reason", reason))
        self.reason = reason


def make_cfg(tmp_path: Path, store_path: Optional[str] = None, **sections: Any) -> Config:
    from gpuguard.simulate.build import build_fake_nvml

    data: dict[str, Any] = {"store": {"path": store_path or str(tmp_path / "state" / "{node}.db"),
                                      "runtime_dir": str(tmp_path / "run")},
                            "simulation": {"workdir": str(tmp_path / "sim"), "fake_nvml": str(build_fake_nvml())},
                            "logging": {"syslog": False}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(yaml.safe_dump(data), source="test")


def gpuguard_dirs() -> dict[str, str]:
    """The test's private state and runtime directories (tests/conftest.py), for a hook started with its own bare
    environment: without them it would share /var/lib/gpuguard and /run/gpuguard with every other test."""
    return {k: os.environ[k] for k in ("GPUGUARD_STATE_DIR", "GPUGUARD_RUNTIME_DIR") if k in os.environ}


def run_sim(ctx: RunContext, cfg: Config, simulate: Optional[str] = None, **kw: Any) -> Any:
    """One whole run of the pipeline (gpuguard.pipeline.run.execute) on the node the config or `simulate` names."""
    from gpuguard.pipeline.run import execute
    from gpuguard.simulate.sources import resolve_sources

    return execute(ctx, cfg, resolve_sources(cfg, ctx.node, simulate), **kw)


def write_scenario(tmp_path: Path, name: str, body: dict[str, Any]) -> str:
    body = {"instance_type": "p5.48xlarge", **body}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


def ctx(kind: str = "prolog", node: str = "n1", gpus: Optional[tuple[int, ...]] = tuple(range(8)),
        job_id: Optional[str] = "77") -> RunContext:
    if kind in ("healthcheck", "manual"):
        return RunContext(kind=kind, node=node)
    return RunContext(kind=kind, node=node, job_id=job_id, gpu_indices=gpus)
