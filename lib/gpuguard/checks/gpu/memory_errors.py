"""GPU memory errors and what only a reset clears: gpu.ecc, gpu.retired_pages, gpu.row_remap,
gpu.recovery_action.

A value NVML could not read on a GPU that has the feature (an error for that query, NOT_SUPPORTED while the
GPU's peers report it, ECC counters unreadable while ECC is on) makes the check incomplete for that GPU, never
ok: the health check lifts a reset-class drain only on a value read as clear (gpuguard.pipeline.undrain.reset_evidence), and
"unreadable" must never pass for "cleared".
"""

from __future__ import annotations

from typing import Optional

from gpuguard.checks._util import fail, gpu_label, mismatch, nvml_gpus, ok, skip, spec_of
from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.model import Action, Finding, GpuInfo, Observations


def check_ecc(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    p = inp.params
    limit, agg = p.get("max_volatile_uncorrected", 0), p.get("max_aggregate_uncorrected")
    findings: list[Finding] = []
    judged = False
    for g in nv.gpus:
        if g.ecc_volatile_uncorrected is not None and g.ecc_volatile_uncorrected > limit:
            findings.append(fail(s, f"{gpu_label(g)}: {g.ecc_volatile_uncorrected} uncorrectable ECC errors since "
                                 "driver load",
                                 "uncorrectable memory error: reset the GPU or reboot so the bad row/page is "
                                 "remapped/retired; replace if it recurs", Action.RESET, gpu=g.index,
                                 volatile_uncorrected=g.ecc_volatile_uncorrected))
        if agg is not None and g.ecc_aggregate_uncorrected is not None and g.ecc_aggregate_uncorrected > agg:
            findings.append(fail(s, f"{gpu_label(g)}: {g.ecc_aggregate_uncorrected} uncorrectable ECC errors over "
                                 f"its lifetime (limit {agg})",
                                 "lifetime uncorrectable errors above the site limit: hardware inspection/RMA",
                                 Action.REPLACE, gpu=g.index, aggregate_uncorrected=g.ecc_aggregate_uncorrected))
        if g.ecc_enabled is False:
            # A mode someone set, not a fault: a reboot does not enable it (nvidia-smi -e 1 first), so it warns,
            # or drains for an admin where the site requires ECC.
            judged = True
            then = " (enabled after the next reboot)" if g.ecc_pending_enabled else ""
            findings.append(mismatch(s, f"{gpu_label(g)}: ECC is disabled{then}",
                                     "enable ECC (`nvidia-smi -i %d -e 1`) and reboot" % g.index,
                                     "fail" if p.get("require_enabled", False) else "warn", gpu=g.index))
            continue
        needed = [("ecc_volatile_uncorrected", "ecc_volatile_uncorrected")]
        if agg is not None:
            needed.append(("ecc_aggregate_uncorrected", "ecc_aggregate_uncorrected"))
        if g.ecc_enabled is None:
            needed.insert(0, ("ecc_enabled", "ecc_mode"))
        # ECC on: its counters exist, whatever NVML answers for them
        unread = nv.unread(g, needed, present=g.ecc_enabled is True)
        if unread:
            findings.append(unread)
        judged = judged or g.ecc_enabled is not None or g.ecc_volatile_uncorrected is not None or bool(unread)
    if not judged:
        return [skip(s, "ECC not supported by these GPUs")]
    if findings:
        return findings
    # lifetime counts stay after the bad rows were remapped: history, said so that it matches nvidia-smi -q
    lifetime = {g.index: g.ecc_aggregate_uncorrected for g in nv.gpus if g.ecc_aggregate_uncorrected}
    history = (f" ({', '.join(f'GPU {i}: {n}' for i, n in sorted(lifetime.items()))} over its lifetime)"
               if lifetime else "")
    return [ok(s, f"ECC enabled, no uncorrectable errors since boot{history}",
               aggregate_uncorrected=lifetime)]


_RETIRED_FIELDS = (("retired_pages_pending", "retired_pages_pending"), ("retired_pages_sbe", "retired_pages_sbe"),
                   ("retired_pages_dbe", "retired_pages_dbe"))


def check_retired_pages(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    limit = inp.params.get("max_retired", 63)
    findings: list[Finding] = []
    judged = False
    for g in nv.gpus:
        unread = nv.unread(g, _RETIRED_FIELDS)
        if not unread and g.retired_pages_pending is None and g.retired_pages_dbe is None \
                and g.retired_pages_sbe is None:
            continue  # Ampere and newer use row remapping instead
        judged = True
        if g.retired_pages_pending:
            findings.append(fail(s, f"{gpu_label(g)}: page retirement pending",
                                 "reset the GPU or reboot to retire the pending pages", Action.RESET, gpu=g.index))
        total = (g.retired_pages_sbe or 0) + (g.retired_pages_dbe or 0)
        if total >= limit:
            findings.append(fail(s, f"{gpu_label(g)}: {total} retired pages (limit {limit})",
                                 "retired-page count at NVIDIA's RMA level: replace the GPU", Action.REPLACE,
                                 gpu=g.index, sbe=g.retired_pages_sbe, dbe=g.retired_pages_dbe))
        if unread:
            findings.append(unread)
    if not judged:
        return [skip(s, "page retirement not supported (row remapping GPUs)")]
    return findings or [ok(s, "no page retirement pending")]


def check_row_remap(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    limit = inp.params.get("max_uncorrectable")

    def faults(g: GpuInfo) -> Optional[list[Finding]]:
        if g.remapped_rows_pending is None and g.remapped_rows_failure is None:
            return None  # pre-Ampere GPUs retire pages instead
        return _row_remap_faults(s, g, limit)

    findings, judged = nv.judge_each([("remapped_rows_pending", "remapped_rows")], faults)
    if not judged:
        return [skip(s, "row remapping not supported (pre-Ampere GPUs)")]
    return findings or [ok(s, "no row remapping pending or failed")]


def _row_remap_faults(s: CheckSpec, g: GpuInfo, limit: int | None) -> list[Finding]:
    ev = {"correctable": g.remapped_rows_correctable, "uncorrectable": g.remapped_rows_uncorrectable}
    if g.remapped_rows_failure:
        return [fail(s, f"{gpu_label(g)}: row remapping failed", "the GPU has no spare rows left: replace it (RMA)",
                     Action.REPLACE, gpu=g.index, **ev)]
    if g.remapped_rows_pending:
        return [fail(s, f"{gpu_label(g)}: row remapping pending",
                     "reset the GPU (nvidia-smi -r) or reboot to apply the remap", Action.RESET, gpu=g.index, **ev)]
    if limit is not None and (g.remapped_rows_uncorrectable or 0) > limit:
        return [fail(s, f"{gpu_label(g)}: {g.remapped_rows_uncorrectable} rows remapped for uncorrectable errors "
                     f"(limit {limit})", "remapped rows above the site limit: hardware inspection/RMA",
                     Action.REPLACE, gpu=g.index, **ev)]
    return []


# NVML_GPU_RECOVERY_ACTION_* -> (name, our action)
RECOVERY_ACTIONS = {
    1: ("GPU_RESET", Action.RESET),
    2: ("NODE_REBOOT", Action.REBOOT),
    3: ("DRAIN_P2P", Action.DRAIN),
    4: ("DRAIN_AND_RESET", Action.RESET),
    5: ("RECOVER_IMEX_DOMAIN", Action.DRAIN),
    6: ("BUS_RESET", Action.RESET),
    7: ("SYSTEM_REBOOT", Action.REBOOT),
}


def check_recovery_action(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    findings, judged = nv.judge_each([("recovery_action", "recovery_action")],
                                     lambda g: _recovery_faults(s, g))
    if not judged:
        return [skip(s, "recovery action not reported (driver older than R565)")]
    return findings or [ok(s, "recovery action NONE on every GPU")]


def _recovery_faults(s: CheckSpec, g: GpuInfo) -> Optional[list[Finding]]:
    if g.recovery_action is None:
        return None
    if g.recovery_action == 0:
        return []
    name, action = RECOVERY_ACTIONS.get(g.recovery_action, (f"UNKNOWN_{g.recovery_action}", Action.REBOOT))
    return [fail(s, f"{gpu_label(g)}: NVML recovery action {name}",
                 f"the driver asks for {name.replace('_', ' ').lower()} before this GPU is used again", action,
                 gpu=g.index, recovery_action=g.recovery_action)]
