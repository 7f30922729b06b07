"""Which NVML GPUs a Slurm job was given. Pure: identifiers in, NVML indices out.

Slurm does not speak NVML indices. In a prolog, `SLURM_JOB_GPUS` / `CUDA_VISIBLE_DEVICES` hold
- integers that are Slurm's GRES indices: with `gres.conf` `File=/dev/nvidia[0-7]` (and with `AutoDetect=nvml`,
  which lists the same device files) GRES index N is the GPU behind /dev/nvidiaN, i.e. NVML *minor number* N. NVML's
  own index follows PCI bus order and may differ (ceems-dev/ceems discussion #513 shows both orders on a 4x H100
  NVL node), so an integer is matched by minor number, not by NVML index (`slurm.gpu_ids: nvml_index` changes that
  for sites whose gres.conf is written in NVML order);
- or UUIDs: `GPU-<uuid>` for a whole GPU, `MIG-<uuid>` (or the older `MIG-GPU-<uuid>/<gi>/<ci>`) for a MIG slice,
  which belongs to its parent GPU.
With MIG enabled, integers are indices of MIG devices among the node's GRES, which nothing here can map without
Slurm's own GRES table: they are reported as unmapped, never guessed, and never drain anything by themselves.
"""

from __future__ import annotations

from typing import Optional, Sequence

from gpuguard.model import GpuInfo
from gpuguard.util.record import Frozen, field, record


@record
class GpuMapping(Frozen):
    indices: tuple[int, ...]  # NVML indices of the job's (parent) GPUs
    unmapped: tuple[str, ...] = ()  # Slurm identifiers that match no GPU NVML reports
    notes: tuple[str, ...] = field(default_factory=tuple)


def resolve_job_gpus(ids: Sequence[str], gpus: Sequence[GpuInfo], mode: str = "minor") -> GpuMapping:
    """Map Slurm's GPU identifiers onto NVML GPUs (`gpus`: the NVML observation's GPUs, all of the node)."""
    by_uuid = {g.uuid.lower(): g.index for g in gpus if g.uuid}
    by_mig = {m.lower(): g.index for g in gpus for m in g.mig_devices}
    by_minor = {g.minor_number: g.index for g in gpus if g.minor_number is not None}
    by_index = {g.index for g in gpus}
    mig_on = any(g.mig_enabled for g in gpus)
    out: list[int] = []
    unmapped: list[str] = []
    notes: list[str] = []
    for raw in ids:
        token = raw.strip()
        low = token.lower()
        idx: Optional[int] = None
        if low.startswith("mig-"):
            idx = by_mig.get(low)
            if idx is None and low.startswith("mig-gpu-"):  # MIG-GPU-<parent uuid>/<gi>/<ci> (R450-R465 drivers)
                idx = by_uuid.get(low[4:].split("/", 1)[0])
        elif low.startswith("gpu-"):
            idx = by_uuid.get(low)
        elif token.isdigit():
            n = int(token)
            if mig_on:
                notes.append(f"GPU id {n} is a MIG GRES index (MIG is on): not mapped to a GPU")
            elif mode == "nvml_index":
                idx = n if n in by_index else None
            elif by_minor:
                idx = by_minor.get(n)
            else:  # minor numbers unreadable: NVML index is the best remaining guess, and it says so
                idx = n if n in by_index else None
                notes.append("minor numbers unavailable: Slurm GPU ids taken as NVML indices")
        if idx is None:
            unmapped.append(token)
        elif idx not in out:
            out.append(idx)
    return GpuMapping(tuple(sorted(out)), tuple(unmapped), tuple(dict.fromkeys(notes)))
