"""Act: apply a verdict to Slurm, durably.

A drain that Slurm could not take (slurmctld down, restarting, hung) is a pending drain in the node's verdict
journal; every later run retries pending drains first, and they stand until applied. Applied exactly once:
`drain_node` never re-applies a drain slurmctld already shows (`already`) and never touches a node someone else
owns (`foreign`: an admin's drain, DOWN, maintenance). Every Slurm call is bounded by the act stage's share of the
run's deadline; once slurmctld did not answer, the run makes no further calls (each would wait its full timeout).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.model import PendingDrain, Verdict
from gpuguard.pipeline.budget import StageBudget
from gpuguard.pipeline.journal import Journal
from gpuguard.slurm.client import DrainOutcome, SlurmError, client_from_config, drain_node, request_reboot


class SlurmHandle:
    """The run's Slurm client, created on first use with the act stage's timeout (or the one a caller injects)."""

    def __init__(self, cfg: Config, budget: Optional[StageBudget], injected: Any = None) -> None:
        self.cfg = cfg
        self.budget = budget
        self.injected = injected
        self._client: Any = None
        self.unreachable: Optional[str] = None  # set once a call failed to reach slurmctld this run

    def client(self) -> Any:
        if self._client is None:
            if self.injected is not None:
                self._client = self.injected
            else:
                scontrol_s = self.cfg.deadlines.scontrol_s
                timeout = self.budget.act_bound(scontrol_s) if self.budget else scontrol_s
                self._client = client_from_config(self.cfg.slurm, timeout)
        return self._client

    def drain(self, node: str, reason: str) -> DrainOutcome:
        if self.unreachable:
            return DrainOutcome("failed", f"not tried: {self.unreachable}")
        try:
            out = drain_node(self.client(), node, reason)
        except SlurmError as e:  # e.g. slurm.backend pyslurm that is not usable
            out = DrainOutcome("failed", str(e))
        if out.outcome == "failed":
            self.unreachable = out.detail[:200]
        return out

    def reboot(self, node: str, reason: str) -> dict[str, str]:
        if self.unreachable:
            return {"outcome": "failed", "detail": f"not tried: {self.unreachable}"}
        out = request_reboot(self.client(), node, reason)
        if out["outcome"] == "failed":
            self.unreachable = out["detail"][:200]
        return out


def new_id() -> str:
    """A pending drain's id: 48 random bits, unique among a node's few pending drains."""
    return os.urandom(6).hex()


def new_pending(verdict: Verdict, origin: str, now: float, op: str = "drain") -> PendingDrain:
    primary = verdict.primary
    return PendingDrain(id=new_id(), op=op, reason=verdict.reason or "", action=verdict.action.value,
                        check_id=primary.check_id if primary else None, created=now, origin=origin)


def retry_pending(journal: Journal, slurm: SlurmHandle, node: str, reboot_auto: bool,
                  now: Optional[float] = None) -> list[dict[str, Any]]:
    """Apply the node's pending drains, oldest first. Returns what was applied ({"pending", "outcome", "detail"});
    the ones still failing stay in the journal with their attempt count."""
    applied: list[dict[str, Any]] = []
    for p in list(journal.pending):
        now = now if now is not None else time.time()
        if p.op == "reboot":
            rb = slurm.reboot(node, p.reason)
            outcome, detail = ("done" if rb["outcome"] == "requested" else "failed"), rb["detail"]
        else:
            out = slurm.drain(node, p.reason)
            outcome, detail = out.outcome, out.detail
        if outcome == "failed":
            p.attempts += 1
            p.last_error, p.last_attempt = detail[:300], now
            break  # slurmctld is not answering: the rest would only wait their timeouts too
        journal.resolve(p.id)
        applied.append({"pending": p, "outcome": outcome, "detail": detail})
        if p.op == "drain" and outcome == "done" and p.action == "reboot" and reboot_auto:
            journal.add_pending(PendingDrain(id=new_id(), op="reboot", reason=p.reason,
                                             action=p.action, check_id=p.check_id, created=now, origin=p.origin,
                                             run_id=p.run_id))
    return applied


def apply_drain(verdict: Verdict, pending: PendingDrain, journal: Journal, slurm: SlurmHandle, node: str,
                reboot_auto: bool, now: Optional[float] = None) -> dict[str, Any]:
    """Drain for `verdict`; `pending` is already durable in the journal (saved by the caller together with the
    kernel-log position). Resolved here when Slurm took it (or someone else owns the node)."""
    out = slurm.drain(node, pending.reason)
    result: dict[str, Any] = {"outcome": out.outcome, "detail": out.detail, "reason": pending.reason,
                              "previous_reason": out.previous_reason}
    pending.attempts += 1
    if out.outcome == "failed":
        pending.last_error, pending.last_attempt = out.detail[:300], now if now is not None else time.time()
        result["pending"] = pending.id
        return result
    journal.resolve(pending.id)
    if out.outcome == "done" and verdict.action.value == "reboot" and reboot_auto:
        result["reboot"] = slurm.reboot(node, pending.reason)
        if result["reboot"]["outcome"] == "failed":
            journal.add_pending(PendingDrain(id=new_id(), op="reboot", reason=pending.reason,
                                             action=pending.action, check_id=pending.check_id,
                                             created=pending.created, origin=pending.origin))
    return result
