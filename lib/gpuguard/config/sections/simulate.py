"""The `simulation:` section: run the same pipeline against a simulated node (the demo, the tests, dry runs)."""

from __future__ import annotations

from typing import Optional

from gpuguard.config.fields import Section, key, mapping, section, string


@section
class SimulationConfig(Section):
    """`simulation:` the scenario a simulated node is built from, and where its files go."""

    # a scenario file, or a directory holding <node>.yaml (falls back to default.yaml)
    scenario: Optional[str] = key(string(allow_none=True), None)
    scenario_dir: Optional[str] = key(string(allow_none=True), None)
    fake_nvml: Optional[str] = key(string(allow_none=True), None)
    workdir: Optional[str] = key(string(allow_none=True), None)
    # the simulated node's tools for the optional tier: {all_reduce_perf: PATH, dcgmi: PATH} (simulated
    # nccl-tests/dcgmi that read the scenario: devtools.nccl_tests_stub, installed by the dev site)
    tools: dict[str, str] = key(mapping, {})
