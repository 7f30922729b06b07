"""fabric.efa_counters: growth of the EFA hardware error counters since the previous run.

Reads `obs.efa_counters` (gpuguard.probes.efa_counters.EfaCounterObservation). Each threshold is the largest
growth allowed between two runs on one port; a threshold left unset is not judged (the deltas are still
reported as evidence, so a site can pick limits from what its fleet shows). The first reading, or the first
after a reboot, only records a baseline. Device count and port state are fabric.efa's job.
"""

from __future__ import annotations

from typing import Any

from gpuguard.checks._util import fail, incomplete, ok, skip, spec_of
from gpuguard.checks.spec import CheckInput
from gpuguard.model import Action, Finding, Observations, Severity

# check parameter -> the hw_counters it limits (summed per port)
PARAM_COUNTERS: dict[str, tuple[str, ...]] = {
    "max_rx_drops": ("rx_drops",),
    "max_retrans_pkts": ("retrans_pkts",),
    "max_retrans_timeout_events": ("retrans_timeout_events",),
    "max_unresponsive_remote_events": ("unresponsive_remote_events",),
    "max_impaired_remote_conn_events": ("impaired_remote_conn_events",),
    "max_rdma_wr_err": ("rdma_read_wr_err", "rdma_write_wr_err"),
}
_REMEDIATE = ("look at `rdma statistic show` / the hw_counters of the port and the instance's EFA health; "
              "drain, stop/start the instance (new hardware) if the errors keep growing")


def check_efa_counters(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    if not inp.profile.efa_devices:
        return [skip(s, "profile expects no EFA devices")]
    limits = {p: inp.params.get(p) for p in PARAM_COUNTERS if inp.params.get(p) is not None}
    c: Any = obs.efa_counters
    if not limits:  # nothing to judge against: never incomplete (that would escalate to a drain)
        growth = _growth(c.deltas) if c is not None and c.status.complete and c.deltas else {}
        ports = len(c.ports) if c is not None and c.status.complete else 0
        return [Finding(s.id, Severity.SKIP, f"no EFA counter thresholds configured (error counters grew on "
                        f"{len(growth)} of {ports} ports)", evidence={"growth": growth})]
    if c is None:
        return [incomplete(s, "EFA counters were not read")]
    if not c.status.complete:
        return [incomplete(s, f"EFA counters unreadable: {c.status.error}")]
    if not c.ports:
        return [incomplete(s, "no EFA hw_counters in sysfs (driver too old or not loaded)")]
    if c.deltas is None:
        return [ok(s, f"{len(c.ports)} EFA ports: baseline recorded ({c.baseline_reason})",
                   ports=len(c.ports))]
    interval = f" in {c.interval_s:.0f}s" if c.interval_s is not None else ""
    growth = _growth(c.deltas)
    over: list[str] = []
    for port, vals in sorted(c.deltas.items()):
        for param, limit in limits.items():
            total = sum(vals.get(name, 0) for name in PARAM_COUNTERS[param])
            if total > int(limit):
                over.append(f"{port} {'+'.join(PARAM_COUNTERS[param])} +{total} (limit {limit})")
    if over:
        return [fail(s, f"EFA error counters grew{interval}: {', '.join(over[:3])}"
                     + (f" +{len(over) - 3} more" if len(over) > 3 else ""), _REMEDIATE, Action.DRAIN,
                     over=over, growth=growth, interval_s=c.interval_s, reset=c.reset)]
    return [ok(s, f"EFA error counters within limits on {len(c.ports)} ports{interval}", growth=growth,
               interval_s=c.interval_s)]


def _growth(deltas: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per port, the error counters that grew (the ones a threshold can limit)."""
    watched = {n for names in PARAM_COUNTERS.values() for n in names}
    out = {port: {n: v for n, v in vals.items() if v and n in watched} for port, vals in deltas.items()}
    return {p: v for p, v in out.items() if v}
