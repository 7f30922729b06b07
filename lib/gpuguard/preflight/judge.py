"""Judging a pre-flight (pure: no I/O, no clock): a worker's output -> a Measurement, a failed or hung collective ->
evidence, a convicted node -> its drain reason, the whole run -> one line for the job's output.

A hang or a failed init is evidence, not an unknown: the measurement gets bus bandwidth 0, so the isolation
(gpuguard.nccl.isolate) treats it like a very slow run and a node is convicted only when it fails beside a node
known good."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from gpuguard.nccl.isolate import Group, Measurement, NodeVerdict, SweepOutcome
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.slurm.reason import format_reason

RESULT_TAG = "GPUGUARD-PREFLIGHT "
CHECK_ID = "fabric.nccl"
KEYWORD = "NCCL"
# no floor configured and no baseline: only a failed or hung collective is judged (anything that ran passes)
NO_FLOOR = 1e-9
# a step that ran out of time is a hang only if a comparable run of the same round finished within this share of the
# time the hung one had: otherwise the machine (load) or the budget stopped it, and that is no evidence
HANG_MARGIN = 0.5
# what a run stopped without evidence says: load or the budget stopped it, not the node
TOO_SLOW = "too slow to judge"
# a run below its floor whose ranks waited for a CPU this share of its timed loop (or more) is starved, not slow:
# gloo's wait on a slow link is sleep, not a run queue (the worker reads /proc/self/task/*/schedstat)
STARVED_SHARE = 0.25


@dataclass(frozen=True)
class Step:
    """One srun step of a round, as it ended."""
    group: Group
    output: str
    rc: Optional[int]
    timed_out: bool
    duration_s: float


def result_line(sizes: list[int], busbw: list[float], backend: str, world: int,
                starved: Optional[float] = None) -> str:
    """One collective's result as one tagged JSON line (`starved`: the largest share of the timed loop a rank spent
    waiting for a CPU)."""
    d: dict[str, Any] = {"sizes": sizes, "busbw_gbps": busbw, "backend": backend, "world": world}
    if starved is not None:
        d["starved"] = starved
    return RESULT_TAG + json.dumps(d)


def parse_result(text: str) -> Optional[dict[str, Any]]:
    """The last well-formed result line of a worker's output, or None."""
    found = None
    for line in text.splitlines():
        if not line.startswith(RESULT_TAG):
            continue
        try:
            d = json.loads(line[len(RESULT_TAG):])
        except ValueError:
            continue
        if isinstance(d, dict) and isinstance(d.get("busbw_gbps"), list) and d["busbw_gbps"]:
            found = d
    return found


def measurement(group: Group, stage: str, *, threshold: Optional[float], output: str, rc: Optional[int],
                timed_out: bool, duration_s: float) -> Measurement:
    """One collective's Measurement: the bus bandwidth of the largest size; a hang or failure is 0 GB/s."""
    thr = threshold if threshold is not None else NO_FLOOR
    res = parse_result(output) if rc == 0 and not timed_out else None
    if res is not None:
        bw, starved = float(res["busbw_gbps"][-1]), res.get("starved")
        if bw < thr and isinstance(starved, (int, float)) and starved >= STARVED_SHARE:
            return Measurement(group, stage, thr, None, int(res["sizes"][-1]), duration_s=duration_s,
                               error=f"{TOO_SLOW}: {bw:.3g} GB/s while its ranks waited for a CPU "
                                     f"{starved:.0%} of the time (the machine is loaded, not the link)")
        return Measurement(group, stage, thr, bw, int(res["sizes"][-1]), duration_s=duration_s)
    if timed_out:
        error = f"hung: no result within {duration_s:.1f}s"
    else:
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        error = f"failed (exit {rc}): {tail[0][:160]}"
    return Measurement(group, stage, thr, 0.0, None, error=error, duration_s=duration_s)


def round_measurements(steps: list[Step], stage: str, threshold_for: Callable[[int], Optional[float]],
                       allowance_s: float, cut_by_budget: bool,
                       quickest: Optional[dict[int, float]] = None) -> list[Measurement]:
    """A round's Measurements. A step stopped at its time is evidence (a hang, 0 GB/s) only when the round had its
    full time (not cut short by the pre-flight's budget) and a run of the same size in the same round gave a result
    within HANG_MARGIN of that time (or, `quickest`, an earlier round's run of that size did: size -> seconds); else
    it is unknown (no bandwidth: the isolation never convicts on it)."""
    done = [s for s in steps if not s.timed_out and s.rc == 0 and parse_result(s.output)]
    out = []
    for s in steps:
        thr = threshold_for(len(s.group))
        thr = thr if thr is not None else NO_FLOOR
        beside = [o.duration_s for o in done if o is not s and len(o.group) == len(s.group)]
        beside += [(quickest or {})[len(s.group)]] if len(s.group) in (quickest or {}) else []
        quick = min(beside) if beside else None
        cut = cut_by_budget and s.duration_s >= allowance_s * 0.98  # stopped by the budget, not by the early stop
        if s.timed_out and (cut or quick is None or quick > s.duration_s * HANG_MARGIN):
            why = ("its share of the pre-flight's budget ran out" if cut else
                   "no run beside it finished in half that time (load, not evidence)")
            out.append(Measurement(s.group, stage, thr, None, duration_s=s.duration_s,
                                   error=f"{TOO_SLOW}: stopped after {s.duration_s:.1f}s: {why}"))
            continue
        m = measurement(s.group, stage, threshold=thr, output=s.output, rc=s.rc, timed_out=s.timed_out,
                        duration_s=s.duration_s)
        if s.timed_out and quick is not None:
            m.error = f"hung: no result within {s.duration_s:.1f}s, a run beside it took {quick:.1f}s"
        out.append(m)
    return out


def peers_of(outcome: SweepOutcome, node: str) -> list[str]:
    """The nodes `node` was measured with in its convicting runs."""
    return sorted({p for m in outcome.measurements if node in m.nodes and m.stage in ("confirm", "pair", "cross")
                   for p in m.nodes if p != node})


def best_peer_gbps(outcome: SweepOutcome) -> Optional[float]:
    """The fastest run without a convicted node: what the job's healthy nodes reach together."""
    slow = set(outcome.slow)
    ok = [m.busbw_gbps for m in outcome.measurements
          if m.busbw_gbps and m.verdict == "ok" and not slow.intersection(m.nodes)]
    return max(ok) if ok else None


def drain_reason(v: NodeVerdict, peers: Iterable[str], healthy_gbps: Optional[float],
                 error: Optional[str] = None) -> str:
    """`gpuguard: NCCL fabric.nccl: busbw 0.1 GB/s vs 2.3 with peers node1 [preflight drain]`."""
    vs = f" vs {healthy_gbps:.3g}" if healthy_gbps else (f" vs floor {v.threshold_gbps:.3g}"
                                                         if v.threshold_gbps and v.threshold_gbps > NO_FLOOR else "")
    what = f"hang or failure ({error})" if error else f"busbw {v.busbw_gbps or 0:.3g} GB/s{vs}"
    # a plain comma list: a reason is sanitized of brackets, so node[1,4] would read "node 1,4"
    return format_reason(CHECK_ID, KEYWORD, f"{what} with peers {','.join(peers) or '-'}", "preflight")


def convicting_error(outcome: SweepOutcome, node: str) -> Optional[str]:
    """The error of the run that convicted `node` (a hang or a failed init), None when it ran slowly."""
    v = outcome.verdicts.get(node)
    if v is None or v.partner is None:
        return None
    for m in reversed(outcome.measurements):
        if set(m.nodes) == {node, v.partner} and m.error:
            return m.error
    return None


def summary_line(nodes: list[str], seconds: float, conclusion: str, blamed: list[str], what: str,
                 up_s: Optional[float] = None, rounds: Sequence[tuple[str, float]] = (),
                 notes: Sequence[str] = ()) -> str:
    """The one line the job's output gets: what was tested, how long it took (the workers' start-up and each
    round), what was blamed; `notes` lead the bracket (where the floor came from, whether the run was recorded)."""
    head = f"gpuguard preflight: {len(nodes)} nodes {compress_hostlist(nodes)} in {seconds:.1f}s: "
    body = f"blamed {compress_hostlist(blamed)} ({what})" if blamed else (what or conclusion)
    parts = [*notes] + ([f"workers up in {up_s:.1f}s"] if up_s is not None else []) + \
        ([f"rounds {' '.join(f'{st} {s:.1f}s' for st, s in rounds)}"] if rounds else [])
    return head + body + (f" [{', '.join(parts)}]" if parts else "")
