"""Blame inside the allocation (pure apart from the `measure` it is given): the all-node collective, then the
sweep's isolation (gpuguard.nccl.isolate: pairs run side by side, every suspect confirmed beside a node known good,
so a one-off blip that a re-test does not reproduce convicts nobody), then the switch rule (gpuguard.preflight.topology)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gpuguard.nccl.isolate import Measure, SweepOutcome, isolate
from gpuguard.preflight.judge import TOO_SLOW, best_peer_gbps, convicting_error, drain_reason, peers_of
from gpuguard.preflight.topology import blamed_switch


@dataclass
class Blame:
    outcome: SweepOutcome
    nodes_to_drain: dict[str, str] = field(default_factory=dict)  # node -> drain reason
    switch: Optional[str] = None
    exclude: list[str] = field(default_factory=list)  # what this job goes on without
    what: str = ""  # one phrase for the job's output

    @property
    def blamed(self) -> list[str]:
        return [self.switch] if self.switch else sorted(self.nodes_to_drain)


def run_blame(nodes: list[str], measure: Measure, switches: Optional[dict[str, list[str]]] = None,
              max_drain_fraction: float = 0.5) -> Blame:
    outcome = isolate(nodes, measure, "pairwise", max_drain_fraction)
    b = Blame(outcome)
    first = outcome.measurements[0] if outcome.measurements else None
    if outcome.conclusion == "pass":
        b.what = f"passed, busbw {first.busbw_gbps:.3g} GB/s" if first and first.busbw_gbps else "passed"
        return b
    switch = blamed_switch(outcome, switches) if switches else None
    if switch:
        b.switch = switch
        b.exclude = sorted(n for n in (switches or {}).get(switch, []) if n in nodes)
        b.what = f"switch {switch}: its nodes slow together, no node drained"
        return b
    if outcome.conclusion == "isolated":
        healthy = best_peer_gbps(outcome)
        for n in outcome.slow:
            b.nodes_to_drain[n] = drain_reason(outcome.verdicts[n], peers_of(outcome, n), healthy,
                                               convicting_error(outcome, n))
        b.exclude = sorted(b.nodes_to_drain)
        b.what = "; ".join(r.split(": ", 1)[1] for r in b.nodes_to_drain.values())
        return b
    slow_to_judge = [m for m in outcome.measurements if m.error and m.error.startswith(TOO_SLOW)]
    if slow_to_judge:  # load or the budget, not the fabric: say so rather than blame the scale or the switch
        b.what = f"{slow_to_judge[0].error.split(': ', 1)[0]} ({len(slow_to_judge)} run(s) stopped: " \
                 f"{slow_to_judge[0].error.split(': ', 1)[-1]}); nothing drained"
        return b
    b.what = f"nothing reproducible ({outcome.message}); nothing drained"
    return b
