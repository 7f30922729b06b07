"""A simulated node once its files are written (gpuguard.simulate.scenario.materialize): where the probes must read,
remembered beside those files so that a hook on a node whose scenario did not change reads no YAML.

The record names the SHA-256 of the scenario's bytes it was written from; a hook reads the (small) scenario file
every run and takes the fast path only when the bytes are the same, so an edited scenario is never missed. The
profile goes through its own compiled copy (gpuguard.profiles.load_profile with a cache directory).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from gpuguard.config.compiled import source_digest
from gpuguard.profiles import Profile, ProfileError, load_profile
from gpuguard.util.record import Record, field, record

RECORD = ".materialized.json"
RECORD_VERSION = 1


class ScenarioError(ValueError):
    pass


@record
class SimSources(Record):
    """Where the probes must read for this simulated node."""

    profile: Profile
    nvml_library: str
    nvml_env: dict[str, str]
    kernel_log: str  # source spec for gpuguard.kernellog.sources
    boot_id: str
    sysfs_root: str
    procfs_root: str
    fi_info: str
    workdir: str
    scenario: str
    notes: list[str] = field(default_factory=list)


def scenario_for_node(scenario: Optional[str], scenario_dir: Optional[str], node: str) -> Optional[str]:
    """A per-node file `<dir>/<node>.yaml` (else `<dir>/default.yaml`), or the single scenario file."""
    if scenario_dir:
        for name in (f"{node}.yaml", "default.yaml"):
            p = os.path.join(scenario_dir, name)
            if os.path.isfile(p):
                return p
        raise ScenarioError(f"no scenario for node {node} in {scenario_dir} (want {node}.yaml or default.yaml)")
    return scenario


def scenario_digest(raw: bytes) -> str:
    return source_digest(raw)[:16]


def sim_sources(workdir: str, scenario_path: str, profile: Profile, fake_nvml: str, boot_id: str) -> SimSources:
    """The paths of a materialised node's files (the layout gpuguard.simulate.scenario writes)."""
    return SimSources(
        profile=profile, nvml_library=fake_nvml, nvml_env={"GPUGUARD_FAKE_NVML_FILE": os.path.join(workdir, "nvml.txt")},
        kernel_log=f"kmsg:{os.path.join(workdir, 'kmsg')}", boot_id=boot_id, sysfs_root=os.path.join(workdir, "sys"),
        procfs_root=os.path.join(workdir, "proc"), fi_info=os.path.join(workdir, "bin", "fi_info"), workdir=workdir,
        scenario=os.path.abspath(scenario_path))


def record_for(scenario_path: str, digest: str, profile_name: str, boot_id: str, fake_nvml: str) -> dict[str, object]:
    return {"version": RECORD_VERSION, "scenario": os.path.abspath(scenario_path), "digest": digest,
            "profile": profile_name, "boot_id": boot_id, "fake_nvml": fake_nvml}


def current(scenario_path: str, workdir: str, fake_nvml: Optional[str],
            profile_dir: Optional[str] = None) -> Optional[SimSources]:
    """The node as materialised last time, when the scenario file still has the same bytes and the node's files
    are there; None otherwise (the caller materialises it again)."""
    if fake_nvml is None:
        return None  # the library is built on the slow path
    try:
        with open(scenario_path, "rb") as f:
            raw = f.read()
        with open(os.path.join(workdir, RECORD), "rb") as f:
            rec = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("version") != RECORD_VERSION \
            or rec.get("scenario") != os.path.abspath(scenario_path) or rec.get("digest") != scenario_digest(raw) \
            or rec.get("fake_nvml") != fake_nvml or not os.path.isfile(os.path.join(workdir, "kmsg")):
        return None
    try:
        profile = load_profile(str(rec["profile"]), profile_dir, cache_dir=workdir)
    except (ProfileError, KeyError, ValueError, OSError):
        return None
    return sim_sources(workdir, scenario_path, profile, fake_nvml, str(rec["boot_id"]))
