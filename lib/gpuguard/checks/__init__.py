"""The check registry: every check is a pure function `(Observations, CheckInput) -> [Finding]`.

Checks know nothing about Slurm, files or time. A check has one home, its `CheckSpec` in `registered.py`: the
probe it needs and what that probe must read for it, the run kinds it belongs to, its parameters (validated config
keys under `checks.<id>`, with defaults), the GPUs it looks at (scope), its priority when several checks fail, the
drain keywords it may emit, whether only a GPU reset clears what it found, whether its failure is unambiguous hardware
evidence, and its runbook section. Every table other modules used to keep (the node-scoped checks, the priority
order, the reset-only checks, the keyword vocabulary) is derived from here.

Adding a check (ARCHITECTURE.md, "Adding a check"; `python -m devtools.newcheck` writes the skeleton): one function
(it receives its spec as `inp.spec`: no re-typed id or keyword), its failing fixture in
tests/unit/test_check_registry.py, one `CheckSpec` line, its documentation (docs/runbooks.md, README's table).

This package re-exports the public names of `spec` (what a check is) and `registered` (the registry and its
tables); the check modules import from those two, never from the package, so there is no import cycle.
"""

from __future__ import annotations

from typing import Any

from gpuguard.checks.registered import (check_keywords, check_priority, cleared_only_by_reset, find_check, get_check,
                                        is_hardware_evidence, node_scope, param_defaults, param_schema, priority_of,
                                        probe_options, registry, run_check)
from gpuguard.checks.spec import ALL_KINDS, IDLE_ONLY, NODE, TIER, CheckFn, CheckInput, CheckSpec, ProbeOptionsFn

__all__ = ["ALL_KINDS", "IDLE_ONLY", "NODE", "TIER", "CheckFn", "CheckInput", "CheckSpec", "ProbeOptionsFn",
           "check_keywords", "check_priority", "cleared_only_by_reset", "find_check", "get_check",
           "is_hardware_evidence", "node_scope", "param_defaults", "param_schema", "priority_of", "probe_options",
           "registry", "run_check"]


def __getattr__(name: str) -> Any:  # the tables other modules imported before they were derived
    if name == "NODE_SCOPE":
        return node_scope()
    raise AttributeError(name)
