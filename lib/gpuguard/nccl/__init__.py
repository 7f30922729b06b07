"""NCCL bandwidth validation: nccl-tests parsers, the single-node probe, the fleet sweep, baselines and the
torch.distributed fallback probe.

Import the submodules you need (`gpuguard.nccl.parse`, `.sweep`, ...): nothing here runs on the prolog's hot
path unless the optional tier is enabled, and this package imports nothing heavy at import time.
"""

from __future__ import annotations

NCCL_STORE_TABLES = ("nccl_sweeps", "nccl_runs", "nccl_samples")
