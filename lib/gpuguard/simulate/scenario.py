"""Simulated hardware: a scenario (YAML) becomes the files the real probes read.

The same code path runs on a real node and in simulation: NVML through the real nvidia-ml-py binding
over a fake `libnvidia-ml.so.1` (fakenvml.c) fed a flat file, the kernel log as a /dev/kmsg-format file,
EFA/IB devices as a fake sysfs tree, `fi_info` as a stub printing a recorded output, memory as a fake
/proc/meminfo. Healthy values are derived from the node's profile, so a scenario only states what is
different (see README "Scenarios").

A scenario is loaded and checked by gpuguard.simulate.spec, and written by gpuguard.simulate.nvmlfile (the fake
NVML's flat file) and gpuguard.simulate.hostfiles (kernel log, sysfs, /proc, tool stubs).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from gpuguard.config.yamlutil import load_yaml_file
from gpuguard.simulate.build import build_fake_nvml
from gpuguard.simulate.hostfiles import sync_kmsg, write_fabric, write_system
from gpuguard.simulate.nvmlfile import nvml_flat_file
from gpuguard.simulate.materialized import RECORD, record_for, scenario_for_node, sim_sources
from gpuguard.simulate.spec import GPU_KEYS, ScenarioError, SimSources, load_scenario

__all__ = ["ScenarioError", "SimSources", "load_scenario", "scenario_for_node", "materialize", "inject",
           "nvml_flat_file"]
from gpuguard.util.fs import atomic_write


# --------------------------------------------------------------------------- materialise


def materialize(scenario_path: str, workdir: str, fake_nvml: Optional[str] = None,
                profile_dir: Optional[str] = None) -> SimSources:
    """Write (or reuse) the simulated node's files under `workdir` and say where the probes must look. A hook on a
    node whose scenario did not change takes gpuguard.simulate.materialized.current instead (no YAML)."""
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    sc = load_scenario(scenario_path, profile_dir, cache_dir=str(root))
    boot_id = str(sc.data.get("boot_id") or "00000000-0000-4000-8000-00000000b001")
    if fake_nvml is None:
        fake_nvml = str(build_fake_nvml())
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a prolog and a health check may materialise at once
        stamp = root / ".scenario"
        key = f"{sc.digest}:{os.path.abspath(scenario_path)}"
        if not stamp.exists() or stamp.read_text() != key:
            (root / RECORD).unlink(missing_ok=True)  # no fast path to half-written files
            atomic_write(root / "nvml.txt", nvml_flat_file(sc))
            write_fabric(root, sc)
            write_system(root, sc)
            stamp.write_text(key)
        sync_kmsg(root, sc, boot_id)
        # last: the fast path trusts the files only once they are all written
        atomic_write(root / RECORD, json.dumps(record_for(scenario_path, sc.digest, sc.profile_name, boot_id,
                                                          fake_nvml)))
    return sim_sources(str(root), scenario_path, sc.profile, fake_nvml, boot_id)


# --------------------------------------------------------------------------- injecting faults at run time


def inject(scenario_path: str, *, kernel_lines: list[str] = (), processes: list[tuple[int, int]] = (),  # type: ignore[assignment]
           set_gpu: Optional[tuple[int, str, Any]] = None) -> None:
    """Change a scenario file in place (atomically), as hardware changes under a running job: append kernel
    log lines, attach live processes to GPUs (`(gpu, pid)`), or set one GPU field."""
    data = load_yaml_file(scenario_path) or {}
    if kernel_lines:
        data.setdefault("kernel_log", [])
        data["kernel_log"] = list(data["kernel_log"] or []) + list(kernel_lines)
    gpus = data.setdefault("gpus", {}) if (processes or set_gpu) else data.get("gpus")
    if processes or set_gpu:
        overrides = gpus.setdefault("overrides", {}) or {}
        gpus["overrides"] = overrides
        for gpu, pid in processes:
            entry = overrides.setdefault(gpu, {}) or {}
            overrides[gpu] = entry
            entry.setdefault("processes", [])
            entry["processes"] = list(entry["processes"] or []) + [{"pid": pid, "used_mib": 4096, "live": True}]
        if set_gpu:
            gpu, key, value = set_gpu
            if key not in GPU_KEYS:
                raise ScenarioError(f"unknown GPU key {key!r}")
            entry = overrides.setdefault(gpu, {}) or {}
            overrides[gpu] = entry
            entry[key] = value
    atomic_write(scenario_path, yaml.safe_dump(data, sort_keys=False))
