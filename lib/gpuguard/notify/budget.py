"""How long notifying may take, in one place. A hook run gives notifications what its own deadline has left:
half of it, at most EMIT_S to emit a run's events and FLUSH_S to flush what earlier runs spooled (a hook only
spools: the hand-off process delivers, gpuguard.notify.handoff); opening the notification state takes at most a
quarter of whatever budget a call has (STATE_TIMEOUT_MIN_S..STATE_TIMEOUT_MAX_S). Pure."""

from __future__ import annotations

EMIT_S = 2.0
FLUSH_S = 3.0
STATE_TIMEOUT_MIN_S = 0.2
STATE_TIMEOUT_MAX_S = 1.0


def emit_budget_s(remaining_s: float) -> float:
    """A hook run's budget for emitting its events, from the time its deadline leaves."""
    return max(0.0, min(EMIT_S, remaining_s / 2))


def flush_budget_s(remaining_s: float) -> float:
    """A health check's budget for flushing what earlier runs spooled."""
    return max(0.0, min(FLUSH_S, remaining_s / 2))


def state_timeout_s(budget_s: float) -> float:
    """How long a call with `budget_s` waits for the notification state's lock."""
    return max(STATE_TIMEOUT_MIN_S, min(STATE_TIMEOUT_MAX_S, budget_s / 4))
