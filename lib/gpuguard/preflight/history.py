"""The pre-flight's I/O with the NCCL history (gpuguard.nccl.history, in the fleet store: `nccl.history_path`, else
`store.path` with {node}=fleet): the baseline proposals its floor comes from, and the sample a passed pre-flight adds
(gpuguard.preflight.floor says which). Neither ever fails the pre-flight: a store that cannot be read gives no
proposal, one that cannot be written records nothing, and the job line says so."""

from __future__ import annotations

import os
import sqlite3
from typing import Any, Optional

from gpuguard.nccl import baseline, history
from gpuguard.nccl.cli_common import history_path
from gpuguard.preflight.floor import Sample

TIMEOUT_S = 2.0  # the store's lock wait: the job is waiting


def load_proposals(cfg: Any, profile: str) -> tuple[list[baseline.Proposal], Optional[str]]:
    """(the baseline proposals for `profile`, why there are none when the store could not be read)."""
    path = history_path(cfg)
    if not os.path.exists(path):  # reading never creates the store
        return [], None
    n = cfg.nccl
    try:
        with history.open_history(path, TIMEOUT_S) as store:
            rows = history.samples(store, profile=profile)
    except (sqlite3.Error, OSError) as e:  # StoreUnavailable is an sqlite3.Error
        return [], f"baseline not read: {e}"
    return baseline.propose(rows, n.baseline_k, n.baseline_margin_pct, n.baseline_min_samples), None


def record_sample(cfg: Any, sample: Sample) -> str:
    """Add a passed pre-flight's sample; what happened, in a few words for the job line."""
    try:
        with history.open_history(history_path(cfg), TIMEOUT_S) as store:
            history.record_samples(store, [sample])
    except (sqlite3.Error, OSError) as e:  # StoreUnavailable is an sqlite3.Error
        return f"sample not recorded: {e}"
    return "sample recorded"
