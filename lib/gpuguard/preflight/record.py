"""A node the pre-flight blamed becomes a standing condition of that node (origin "preflight"), written on the node
itself (`gpuguard preflight --record-drain`, run there by `srun -w NODE`) into its own verdict journal under its
lock, with a pending drain that gpuguard.pipeline.act then applies: like any other condition it stands, the
node's prolog refuses jobs and every hook makes Slurm agree, until an admin's `gpuguard undrain` (the health check
never runs this collective, so it never clears it by itself)."""

from __future__ import annotations

import time
from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.model import PendingDrain
from gpuguard.pipeline.act import SlurmHandle, new_id, retry_pending
from gpuguard.pipeline.conditions import Condition, merge
from gpuguard.pipeline.journal import journal_for, runtime_dir
from gpuguard.pipeline.lock import NodeLock, lock_path
from gpuguard.preflight.judge import CHECK_ID, KEYWORD

ORIGIN = "preflight"


def preflight_condition(reason: str, message: str, evidence: dict[str, Any], now: float,
                        boot_id: Optional[str] = None) -> Condition:
    """The condition for a blamed node (pure)."""
    ev = {k: v for k, v in evidence.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    return Condition(id=new_id(), check_id=CHECK_ID, keyword=KEYWORD, action="drain", reason=reason,
                     message=message[:200], first_seen=now, last_seen=now, origin=ORIGIN, boot_id=boot_id,
                     evidence=ev)


def record_drain(cfg: Config, node: str, reason: str, message: str, evidence: dict[str, Any],
                 slurm_client: Any = None, now: Optional[float] = None) -> dict[str, Any]:
    """Write the condition and its pending drain into `node`'s journal, then apply it. {"outcome", "detail"}."""
    now = time.time() if now is None else now
    rd = runtime_dir(cfg)
    with NodeLock(lock_path(rd, node), 10.0) as locked:
        if not locked:
            return {"outcome": "failed", "detail": "the node's lock could not be taken"}
        j = journal_for(cfg, node)
        j.conditions, _ = merge(j.conditions, [preflight_condition(reason, message, evidence, now)])
        j.add_pending(PendingDrain(id=new_id(), op="drain", reason=reason, action="drain", check_id=CHECK_ID,
                                   created=now, origin=ORIGIN))
        err = j.save()
        if err is not None:
            return {"outcome": "failed", "detail": f"journal not written: {err}"}
        applied = retry_pending(j, SlurmHandle(cfg, None, slurm_client), node, False, now)
        j.save()
    if not applied:
        return {"outcome": "pending", "detail": "recorded; Slurm did not take the drain yet (retried by the hooks)"}
    return {"outcome": applied[-1]["outcome"], "detail": applied[-1]["detail"]}
