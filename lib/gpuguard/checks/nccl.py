"""nccl.busbw: the optional tier's single-node all_reduce judged against the profile's bus-bandwidth floor.

Reads `obs.nccl` (gpuguard.nccl.probe.NcclObservation). The figure judged is the bus bandwidth of the largest
message measured (the plateau a slow NVLink/GPU pulls down), never nccl-tests' "Avg bus bandwidth", which
averages in latency-bound small messages. Threshold: the check's `min_busbw_gbps`, else the profile's
`nccl_busbw_gbps`; none configured -> skipped, never guessed. nccl-tests missing or a run without a result
table -> incomplete, never a hardware failure; wrong results (`#wrong` / out-of-bounds values) -> fail.
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.checks._util import fail, incomplete, ok, spec_of
from gpuguard.checks.spec import CheckInput
from gpuguard.model import Action, Finding, Observations, Severity

_REMEDIATE_SLOW = ("run `all_reduce_perf -b 512M -e 4G -f 2 -g 8` by hand and `nvidia-smi nvlink -s` / "
                   "`nvidia-smi topo -m`; check NVLink errors, clocks and PCIe; reboot, replace if it persists")
_REMEDIATE_WRONG = ("the collective returned wrong data: check `dmesg` for Xids and NVLink/ECC errors, run "
                    "`dcgmi diag -r 3`; do not run jobs on this node until it passes")


def _threshold(inp: CheckInput) -> Optional[float]:
    value = inp.params.get("min_busbw_gbps")
    if value is None:
        value = inp.profile.nccl_busbw_gbps
    return float(value) if value is not None else None


def check_nccl_busbw(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    probe: Any = obs.nccl
    if probe is None:
        return [incomplete(s, "the single-node NCCL test was not run")]
    if getattr(probe, "tool_missing", False):
        what = "torch" if getattr(probe, "backend", "") == "torch" else (getattr(probe, "binary", None) or "nccl-tests")
        return [incomplete(s, f"{what} not installed: bandwidth not measured",
                           error=probe.status.error)]
    result = getattr(probe, "result", None)
    if result is None or not result.rows:
        why = getattr(probe, "error", None) or probe.status.error or "no result table"
        return [incomplete(s, f"NCCL test produced no result: {why}"[:200],
                           exit_code=getattr(probe, "exit_code", None))]
    evidence = result.summary()
    max_wrong = int(inp.params.get("max_wrong", 0) or 0)
    wrong = result.wrong_total
    oob = result.out_of_bounds
    bad = max(int(wrong or 0), int(oob or 0))
    if bad > max_wrong:
        return [fail(s, f"all_reduce returned wrong data: {bad} wrong/out-of-bounds values",
                     _REMEDIATE_WRONG, Action.REBOOT, **evidence)]
    threshold = _threshold(inp)
    size, busbw = result.large_busbw()
    if threshold is None:
        return [Finding(s.id, Severity.SKIP,
                        f"no bus-bandwidth threshold configured (measured {busbw} GB/s at {size} B)",
                        evidence=evidence)]
    if busbw is None:
        return [incomplete(s, "no bus bandwidth in the result", **evidence)]
    label = f"{size / 2**30:g} GiB" if size and size >= 2**30 else f"{(size or 0) / 2**20:g} MiB"
    if busbw < threshold:
        return [fail(s, f"all_reduce busbw {busbw:.1f} GB/s < {threshold:g} GB/s at {label}",
                     _REMEDIATE_SLOW, Action.DRAIN, threshold_gbps=threshold, **evidence)]
    return [ok(s, f"all_reduce busbw {busbw:.1f} GB/s at {label} (>= {threshold:g})",
               threshold_gbps=threshold, **evidence)]
