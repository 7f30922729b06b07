"""The drain-storm guard's I/O (the decision is gpuguard.pipeline.storm's): a node's mark in Slurm, the census, and
what a held node remembers.

- **Before a drain** that the guard may hold (`StormGuard.decide`): the node reads its own Comment, writes its
  intent mark where it may, waits a moment (gpuguard.pipeline.run.STORM_SETTLE_S) for the rest of its health-check round, takes one census, decides.
  A node that drains removes its mark once the drain is in (`after_drain`); a held one marks itself held.
- **A census that cannot be taken** (sinfo missing or failing, slurmctld unreachable) holds the drain and pages:
  the guard is never silently off. Nothing is cached then: the next run tries again.
- **Held**: the decision is kept for the storm window in `<runtime dir>/<node>.storm.json`; while it stands and the
  same check fails, the node is held without another census (10,000 held nodes must not read the whole node table
  every health check) and without another page. When that check passes again (a health check, `release`), the
  held mark is removed from Slurm and the decision forgotten.
- **Shared components** (leaf switches from `scontrol show topology`, racks/PDUs from `slurm.shared_components_file`)
  are read only when a census was taken (one bounded scontrol call; a site file that cannot be read is noted and
  left out): a component at fault holds the node with a mark naming it, and the page names the component
  (`switch leaf7`, alert labels `component`, `component_kind` and `switch`/`rack`/...: the kind).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

from gpuguard.pipeline.journal import runtime_dir
from gpuguard.pipeline.storm import Decision, component_ref, decide, format_mark, may_mark, parse_mark, settings_from
from gpuguard.slurm.client import SlurmError
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.util.fs import atomic_write

def state_path(cfg: Any, node: str) -> str:
    return os.path.join(runtime_dir(cfg), f"{node}.storm.json")


class Hold:
    """A drain the guard holds back: why, and what to page (nothing when the storm was paged already)."""

    def __init__(self, why: str, events: Optional[list[Any]] = None) -> None:
        self.why = why
        self.events = events or []


class StormGuard:
    def __init__(self, cfg: Any, slurm: Any, node: str, clock: Callable[[], float],
                 settle_s: Callable[[], float]) -> None:
        self.cfg, self.slurm, self.node, self.clock = cfg, slurm, node, clock
        self.settle_s = settle_s  # how long this run may wait for its round (the run's budget decides)
        self.path = state_path(cfg, node)
        self.marked: Optional[str] = None  # the mark this run wrote in the node's Comment
        self.notes: list[str] = []  # what the run should log (a site file of shared components that is wrong)

    # ------------------------------------------------------------------ before a drain
    def decide(self, verdict: Any) -> Optional[Hold]:
        """None: the drain goes ahead. Otherwise the drain is held (never applied)."""
        check = verdict.primary.check_id
        census = getattr(self.slurm.client(), "census", None)
        if census is None:
            return None  # a Slurm client with no census at all (an in-memory test double): nothing to guard with
        kept = self._kept(check)
        if kept is not None:
            return Hold(f"{kept['why']} (held since {time.strftime('%H:%M:%S', time.localtime(kept['since']))}, "
                        "no new census until the storm window ends)")
        if self.slurm.unreachable:
            return self._no_census(verdict, self.slurm.unreachable)
        now = self.clock()
        if self._mark("intent", check, now):
            time.sleep(max(0.0, self.settle_s()))
        try:
            rows = census()
        except SlurmError as e:
            self.clear_mark()
            return self._no_census(verdict, str(e))
        d = decide(rows, self.node, check, now, settings_from(self.cfg.policy), self._components())
        if d.hold is None:
            return None
        part = component_ref(d.component) if d.component is not None else ""
        if self.marked:
            self._mark("held", check, now, part)
        self._keep(check, d.hold, now, part)
        event = self._shared_event(verdict, d) if d.component is not None else self._storm_event(verdict, d)
        return Hold(d.hold, [event] if d.page else [])

    def _components(self) -> list[Any]:
        from gpuguard.slurm.components import load_components  # cold path: a census was taken

        found, problems = load_components(self.cfg.slurm, float(self.cfg.deadlines.scontrol_s))
        self.notes += problems
        return found

    def after_drain(self) -> None:
        """The drain is in (or pending): the node counts by its drain now, its intent mark goes."""
        self.clear_mark()

    def _no_census(self, verdict: Any, error: str) -> Hold:
        why = (f"no census of the partitions could be taken ({error[:200]}): a drain for a check that can fail on "
               "every node at once is held until one can (slurm.sinfo)")
        from gpuguard.notify import Event  # cold path: a held drain pages

        return Hold(why, [Event(kind="storm", severity="critical", node=self.node, check_id=verdict.primary.check_id,
                                reason=verdict.reason, message=f"not drained ({verdict.reason}): {why}",
                                action="make `sinfo` work for the hooks (slurm.sinfo, slurm.conf); if the hardware "
                                       "is really broken, drain the node by hand")])

    def _storm_event(self, verdict: Any, d: Decision) -> Any:
        from gpuguard.notify import Event  # cold path: a held drain pages

        check = verdict.primary.check_id
        window = self.cfg.policy.storm_window_s
        return Event(
            kind="storm", severity="critical", node=self.node, check_id=check, reason=verdict.reason,
            dedup_key=f"gpuguard/storm/{d.partition}/{check}",
            message=(f"drain storm: {check} fails on {len(d.drained) + len(d.held)} of {d.size} nodes of partition "
                     f"{d.partition} at once. Drained (the first {d.limit}): {compress_hostlist(d.drained) or '-'}. "
                     f"Held, not drained: {compress_hostlist(d.held)}. Nodes that fail it later within "
                     f"{window / 60:g} min are held without another page (their Comment says so). "
                     f"Reason they would have: {verdict.reason}"),
            action="a human decides: if the hardware is really broken drain the nodes by hand; if it is a "
                   "configuration or launch choice applied to every node, fix the profile/config "
                   "(`sinfo -N -O NodeList,Comment` lists the held nodes)")

    def _shared_event(self, verdict: Any, d: Decision) -> Any:
        from gpuguard.notify import Event  # cold path: a held drain pages

        c, check = d.component, verdict.primary.check_id
        assert c is not None
        return Event(
            kind="storm", severity="critical", node=self.node, check_id=check, reason=verdict.reason,
            dedup_key=f"gpuguard/{c.kind}/{c.name}/{check}", component=c.name, component_kind=c.kind,
            evidence={c.kind: c.name, "failing": d.failing, "nodes": len(c.nodes)},
            message=(f"{c.label}: {check} fails on {d.failing} of the {len(c.nodes)} nodes under it within "
                     f"{self.cfg.policy.storm_window_s / 60:g} min: one {c.kind} fault, not {d.failing} node faults. "
                     f"Held, not drained: {compress_hostlist(d.held) or '-'}. Drained before it was seen: "
                     f"{compress_hostlist(d.drained) or '-'}. Its other nodes that fail it later are held without "
                     f"another page (their Comment names {c.kind}={c.name}). Reason they would have: {verdict.reason}"),
            action=(f"look at {c.label} (its ports, cabling, power, logs) rather than at its nodes; once it is "
                    "fixed the held nodes' health checks pass and let go. If the nodes themselves are broken, drain "
                    "them by hand (`sinfo -N -O NodeList,Comment` lists the held nodes)"))

    # ------------------------------------------------------------------ held nodes
    def release(self, failing: set[str]) -> None:
        """A health check: a held check that no longer fails lets go of its hold (mark and decision)."""
        kept = self._read()
        if kept is None or kept.get("check") in failing:
            return
        self.marked = format_mark("held", kept["check"], kept["since"], str(kept.get("component") or "")) \
            if kept.get("marked") else None
        self.clear_mark()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _kept(self, check: str) -> Optional[dict[str, Any]]:
        kept = self._read()
        if kept is None or kept.get("check") != check or self.clock() >= float(kept.get("until", 0)):
            return None
        return kept

    def _keep(self, check: str, why: str, now: float, component: str = "") -> None:
        data = {"check": check, "why": why, "since": now, "until": now + float(self.cfg.policy.storm_window_s),
                "marked": bool(self.marked), "component": component}
        try:
            atomic_write(self.path, json.dumps(data))
        except OSError:
            pass  # not kept: the next run takes another census

    def _read(self) -> Optional[dict[str, Any]]:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and "check" in data and "since" in data else None

    # ------------------------------------------------------------------ the node's Comment
    def _mark(self, state: str, check: str, now: float, component: str = "") -> bool:
        """Write this node's mark, only over an empty Comment or a mark of gpuguard's. False: not written."""
        client = self.slurm.client()
        if getattr(client, "set_comment", None) is None:
            return False
        try:
            if self.marked is None:  # its Comment as it is now (the census after the mark would be too late)
                st = client.get_node(self.node)
                if st is None or not may_mark((st.fields or {}).get("Comment")):
                    return False
            text = format_mark(state, check, now, component)
            client.set_comment(self.node, text)
        except SlurmError:
            return False
        self.marked = text
        return True

    def clear_mark(self) -> None:
        """Remove the mark this run wrote (only while it is still there: an admin may have written since)."""
        if not self.marked:
            return
        client = self.slurm.client()
        try:
            st = client.get_node(self.node)
            here = parse_mark((st.fields or {}).get("Comment")) if st is not None else None
            if here is not None and here == parse_mark(self.marked):
                client.set_comment(self.node, "")
        except SlurmError:
            pass  # a stale mark: an intent counts for INTENT_TTL_S, a held mark for the storm window
        self.marked = None
