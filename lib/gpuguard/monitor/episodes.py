"""The monitor's alerts, one message per episode: an alert is sent when its condition starts and not again while
it lasts, resolved once it has been clear for a while; a job's hang is reported (and the job requeued) by the one
node that claims it. Stack dumps and the requeue command are bounded (gpuguard.monitor.actions)."""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.monitor.actions import (claim_hang, dump_stacks, find_py_spy, hang_claim_path, job_python_pids,
                                      release_hang, requeue)
from gpuguard.monitor.culprit import Culprit, find_stuck
from gpuguard.monitor.detect import Alert
from gpuguard.monitor.jobdir import JobDir
from gpuguard.config.sections.monitor import MonitorConfig
from gpuguard.monitor.log import log as _log
from gpuguard.notify import Event, emit, flush
from gpuguard.probes.nvml import normalize_pci_bus_id


class AlertEpisodes:
    """The alert half of `gpuguard.monitor.loop.Monitor` (a mixin: the monitor's __init__ sets these)."""

    cfg: Config
    p: MonitorConfig
    node: str
    job_id: Optional[str]
    interval: float
    started: float
    restart: str
    jobdir: JobDir
    gpus: Any
    active: dict[str, Alert]
    clear_streak: dict[str, int]
    gpu_ids: dict[int, dict[str, Any]]
    hang_claim: Optional[str]
    notify_state: Optional[str]
    py_spy_missing_told: bool
    hang_label: Optional[str]  # the nodes this node's hang page named (its resolution names the same)

    def _notify(self, event: Any, budget_s: float = 2.0) -> str:
        return emit(self.cfg, event, budget_s=budget_s, state_path=self.notify_state)

    def _gpu_identity(self, index: int) -> dict[str, Any]:
        """UUID, serial and PCI address of a GPU for its alerts (asked once per GPU; NVML may not know all)."""
        if index not in self.gpu_ids:
            ident: dict[str, Any] = {"index": index}
            handle, nv = dict(self.gpus.handles).get(index), self.gpus.nv
            if handle is not None and nv is not None:
                for key, fn in (("uuid", "nvmlDeviceGetUUID"), ("serial", "nvmlDeviceGetSerial"),
                                ("pci_bus_id", "nvmlDeviceGetPciInfo")):
                    try:
                        value = getattr(nv, fn)(handle)
                        value = getattr(value, "busId", value)
                        value = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
                        if value:
                            ident[key] = normalize_pci_bus_id(value) if key == "pci_bus_id" else value
                    except Exception:  # noqa: BLE001 - NOT_SUPPORTED, a lost GPU: the index still names it
                        pass
            self.gpu_ids[index] = ident
        return self.gpu_ids[index]

    def _event(self, a: Alert, now: float, state: str = "firing", message: Optional[str] = None,
               evidence: Optional[dict[str, Any]] = None) -> Any:
        ev = dict(a.evidence if evidence is None else evidence)
        if a.gpu is not None:
            ev["gpu"] = a.gpu
        node = self.hang_label if a.kind == "hang" and self.job_id and self.hang_label else self.node
        return Event(kind=a.kind, node=node, message=message or a.message, severity=a.severity,
                     check_id=a.check_id, action=a.action if state == "firing" else None, job_id=self.job_id,
                     evidence=ev, ts=now, state=state, gpu=a.gpu,
                     gpus=[self._gpu_identity(a.gpu)] if a.gpu is not None else [],
                     # a hang is the job's: one incident per job, whichever node reports or resolves it
                     scope="job" if a.kind == "hang" and self.job_id else "node")

    def _record(self, event: dict[str, Any]) -> None:
        try:
            self.jobdir.record_event(event)
        except OSError:
            pass

    def _claim_hang(self, now: float) -> tuple[bool, bool]:
        """(this node holds the job's hang episode, it has just opened it and pages). The monitor runs on every
        node of the job: N nodes must not page N times."""
        if not self.job_id:
            return True, True
        if self.hang_claim is None:
            self.hang_claim = hang_claim_path(self.jobdir.path("claims"), self.job_id, self.restart)

        def alive(owner: str) -> bool:  # its monitor still writes reports
            try:
                return owner in self.jobdir.read_reports(max(3 * self.interval, 60.0), now)
            except OSError:
                return True  # cannot tell: never page twice

        try:
            outcome = claim_hang(self.hang_claim, self.node, now, alive)
        except OSError as e:  # the job directory is unusable: two pages are better than none
            _log(f"cannot claim the job's hang in {self.jobdir.root}: {e}; reporting it from this node")
            return True, True
        return outcome in ("new", "mine", "adopted"), outcome == "new"

    def _release_hang(self) -> bool:
        """True when this node held the job's hang episode (and has now closed it)."""
        if not self.job_id:
            return True
        if self.hang_claim is None:
            return False
        try:
            return release_hang(self.hang_claim, self.node)
        except OSError:
            return False

    def _fire(self, now: float, alerts: list[Alert]) -> list[str]:
        """An alert is sent when its condition starts (per node, GPU and check) and not again while it lasts;
        a job's hang is sent once by the node that claims it first (which also requeues)."""
        fired = []
        for a in alerts:
            self.clear_streak.pop(a.key, None)
            if a.key in self.active:
                continue
            self.active[a.key] = a
            evidence = dict(a.evidence)
            pages, page = True, a
            if a.kind == "hang":
                summary, dump = self._dump_stacks(now)  # every node dumps its own (when py-spy is configured)
                if summary:
                    evidence["stacks"] = summary
                if dump:
                    evidence["stack_dump"] = dump
                _, pages = self._claim_hang(now)
                if pages:
                    page, evidence = self._hang_page(a, now, evidence)
            _log(f"{a.severity.upper()} {a.check_id}: {a.message}")
            self._record({"ts": now, "node": self.node, "kind": a.kind, "check": a.check_id,
                          "severity": a.severity, "message": a.message, "gpu": a.gpu, "reported": pages,
                          **({"stuck": evidence.get("stuck_nodes")} if page is not a else {})})
            if not pages:
                continue  # another node reports this job's hang (and requeues), or this node already did
            fired.append(f"{a.check_id}:{self._notify(self._event(page, now, evidence=evidence))}")
            if a.kind == "hang" and self.p.requeue_on_hang and self.job_id:
                self._requeue(now, a, list(evidence.get("stuck_nodes") or []))
        return fired

    def _resolve(self, now: float, current: set[str]) -> list[str]:
        """An episode ends when its condition has been clear for `straggler_samples` samples in a row (a hang:
        when progress resumes): a "resolved" message with the alert's dedupe key."""
        out = []
        for key, a in list(self.active.items()):
            if key in current:
                continue
            self.clear_streak[key] = self.clear_streak.get(key, 0) + 1
            if a.kind != "hang" and self.clear_streak[key] < max(1, self.p.straggler_samples):
                continue
            del self.active[key]
            self.clear_streak.pop(key, None)
            if a.kind == "hang":
                if any(x.kind == "hang" for x in self.active.values()) or not self._release_hang():
                    continue  # still hung here, or another node holds the job's hang
                message = f"the job makes progress again ({a.check_id} cleared; it was: {a.message})"
            else:
                message = f"cleared: {a.message}"
            out.append(self._send_resolved(a, now, message))
        return out

    def _send_resolved(self, a: Alert, now: float, message: str, budget_s: float = 2.0) -> str:
        _log(f"RESOLVED {a.check_id}: {message}")
        self._record({"ts": now, "node": self.node, "kind": a.kind, "check": a.check_id, "state": "resolved",
                      "message": message, "gpu": a.gpu})
        return f"{a.check_id}:{self._notify(self._event(a, now, state='resolved', message=message), budget_s)}"

    def resolve_all(self, why: str, budget_s: float = 10.0) -> list[str]:
        """The job ended (the monitor was stopped by srun/scancel): every open episode is resolved, so receivers
        do not keep incidents open for a job that is gone; one last try at the spool."""
        now, end = time.time(), time.monotonic() + budget_s
        out, hang_done = [], False
        for key, a in list(self.active.items()):
            left = end - time.monotonic()
            if left <= 0.2:
                break
            del self.active[key]
            if a.kind == "hang":
                if hang_done or not self._release_hang():
                    continue
                hang_done = True
            out.append(self._send_resolved(a, now, f"{why} (it was: {a.message})", min(2.0, left)))
        left = end - time.monotonic()
        if left > 0.2:
            flush(self.cfg, budget_s=min(2.0, left), state_path=self.notify_state)
        return out

    def _hang_page(self, a: Alert, now: float, evidence: dict[str, Any]) -> tuple[Alert, dict[str, Any]]:
        """The page for the job's hang names the nodes that look stuck (gpuguard.monitor.culprit), not this node
        that happened to claim it; it points only at stack dumps that were written."""
        try:
            reports = self.jobdir.read_reports(max(3 * self.interval, 60.0), now)
        except OSError:
            reports = {}
        reports.setdefault(self.node, {"node": self.node})
        c: Culprit = find_stuck(reports, now, self.interval)
        self.hang_label = c.label if self.job_id else None
        dumps = self._written_dumps(evidence.get("stack_dump"))
        evidence = {**evidence, "stuck_nodes": list(c.nodes), "stuck_why": c.why, "reported_by": self.node}
        if dumps:
            evidence["stack_dumps"] = dumps
        stuck = f"stuck: {c.why}" if c.nodes else c.why
        if dumps:
            action = (f"look at the Python stack dumps ({', '.join(dumps)}): a collective waiting for a dead rank? "
                      "then cancel or requeue")
        elif not self.p.py_spy:
            action = ("no stack dump was taken (monitor.py_spy is null): run `py-spy dump --pid PID` on the stuck "
                      "node's ranks, then cancel or requeue")
        else:
            action = ("no stack dump was written (see the monitor's log in the job output): run `py-spy dump --pid "
                      "PID` on the stuck node's ranks, then cancel or requeue")
        return dataclasses.replace(a, message=f"{a.message}; {stuck}; reported by {self.node}", action=action), \
            evidence

    def _written_dumps(self, mine: Optional[str]) -> list[str]:
        """This attempt's stack dumps that exist now, on any node (the others may still be writing theirs)."""
        found = [p for p in sorted(glob.glob(os.path.join(self.jobdir.path("stacks"), "*.txt")))
                 if os.path.getmtime(p) >= self.started - 1]
        return list(dict.fromkeys(([mine] if mine and os.path.exists(mine) else []) + found))[:16]

    def _dump_stacks(self, now: float) -> tuple[Optional[str], Optional[str]]:
        """(a summary for the evidence, the dump file when one holds stacks). monitor.py_spy null: nothing at all
        (never dumps, says nothing); configured but not found: said once per monitor."""
        if not self.p.py_spy:
            return None, None
        py_spy = find_py_spy(self.p.py_spy)
        if py_spy is None:
            summary = f"no stack dump: py-spy ({self.p.py_spy}) not found on this node"
            if not self.py_spy_missing_told:
                self.py_spy_missing_told = True
                _log(f"{summary} (pip install py-spy, or set monitor.py_spy to its path, or to null)")
            return summary, None
        try:
            pids = job_python_pids(self.job_id, self.gpus.gpu_pids() if not self.gpus.init_error else [])
            summary, path = dump_stacks(py_spy, pids, self.jobdir.stacks_path(self.node, now),
                                        self.p.command_timeout_s)
        except Exception as e:  # noqa: BLE001
            summary, path = f"stack dump failed: {type(e).__name__}: {e}", None
        _log(summary)
        return summary, path

    def _requeue(self, now: float, alert: Alert, stuck: list[str]) -> None:
        """Ask for the job's requeue, once per attempt (one node's claim). The intent is recorded in the job
        directory before the command runs, its outcome after: `gpuguard job-attempt end` reads them to call the
        stop a hang, and the batch shell's USR1 may end the attempt before the command even returns."""
        if not self.jobdir.claim(f"requeue-{self.job_id}-{int(self.started)}", self.node):
            return
        ask = {"ts": now, "node": self.node, "kind": "requeue", "check": alert.check_id, "stuck": stuck}
        self._record({**ask, "phase": "asking"})
        ok, detail = requeue(self.p.requeue_command, str(self.job_id), self.p.command_timeout_s)
        _log(f"requeue after {alert.check_id}: {detail}")
        self._record({**ask, "phase": "done", "ok": ok, "detail": detail})
        what = {True: "requeue requested", False: "requeue FAILED", None: "requeue asked, no answer"}[ok]
        self._notify(Event(kind="requeue", node=self.hang_label or self.node, job_id=self.job_id,
                           check_id=alert.check_id, severity="warning" if ok else "critical",
                           message=f"job {self.job_id} {what} after: {alert.message}",
                           evidence={"command": detail, "reported_by": self.node, "stuck_nodes": stuck}, ts=now,
                           scope="job",
                           action=None if ok else "check that the job was requeued; requeue or cancel it by hand"))
