"""What gpuguard tells humans about: the `Event`, its kinds, and the stable key of the incident it belongs to.
Pure (no I/O, no clock: an Event's time is given by whoever makes it; the default is the moment it is made)."""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Optional

from gpuguard.config.sections.notify import NotifyConfig

KINDS = ("drain", "undrain", "prolog_failure", "straggler", "hang", "requeue", "internal_error", "flapping",
         "resource", "unknown_xid", "storm", "mismatch", "gave_up", "network")  # resource: a monitor threshold (CPU, memory, disk, GPU temperature/power/ECC) during a job
SEVERITIES = ("info", "warning", "critical")
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
RESOLVING_KINDS = {"undrain"}  # kinds that are, by themselves, the resolution of an episode
# The episode an event belongs to: an undrain resolves the node's drain; FLAPPING is the same drain, escalated.
FAMILY = {"undrain": "drain", "flapping": "drain"}
# Transitions Slurm confirmed (a node that was not drained by gpuguard is drained now; its reason became
# FLAPPING): never folded into an open episode, whatever the state says (a missed resolve must not silence them).
ALWAYS_SEND = {"drain", "flapping"}
JOB_FAMILIES = {"straggler", "hang", "resource", "requeue", "gave_up"}  # their keys name the job (one incident per job)
MAX_KEY_LEN = 255  # PagerDuty's dedup_key limit

# What a human should do next, when the caller did not say (every message names one).
DEFAULT_ACTIONS = {
    "drain": "fix what the reason names (reset / reboot / replace), then let the health check undrain it "
             "(or `gpuguard undrain NODE`)",
    "undrain": "none: the check that drained the node passes again",
    "prolog_failure": "none for the job (Slurm requeues it on other nodes); inspect the node: "
                      "`gpuguard history --node NODE`",
    "straggler": "check the GPU's clocks, cooling and power (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE`); "
                 "drain the node if it persists",
    "hang": "look at the stack dumps, then cancel or requeue the job (`scontrol requeue JOBID`)",
    "requeue": "none: the job was requeued; check it resumes from its last checkpoint",
    "gave_up": "the job will not run again by itself: read its ledger (attempts.jsonl in the job directory) and "
               "output, fix the cause, resubmit",
    "internal_error": "a gpuguard bug or an unreadable config: see the log (nodes were not drained: fail-open)",
    "flapping": "the node keeps failing and recovering: inspect the hardware before undraining it by hand",
    "resource": "look at what the job is doing on the node (memory, disk, data loader workers); the job may fail",
    "storm": "a human decides: many nodes failing one check at once is usually a configuration or launch choice "
             "(fix it); if the hardware is really broken, drain the nodes by hand",
    "network": "look at the switch (its ports, cabling, logs) rather than at its nodes: no node was drained, the job "
               "ran without them; `gpuguard nccl sweep` re-tests its nodes once it is fixed",
    "mismatch": "the node differs from its profile but has not changed since first seen (a launch choice): fix the "
                "profile or the launch; nothing was drained",
    "unknown_xid": "look the code up in NVIDIA's Xid catalog (`gpuguard xid explain CODE`) and, if it is a fault, "
                   "add `xid: {overrides: {CODE: {severity: fatal}}}`; the node was not drained for it",
}


@dataclass
class Event:
    kind: str  # one of KINDS
    node: str
    message: str
    severity: str = "warning"  # critical|warning|info
    check_id: Optional[str] = None
    action: Optional[str] = None
    reason: Optional[str] = None
    job_id: Optional[str] = None
    evidence: dict = field(default_factory=dict)  # type: ignore[type-arg]
    ts: float = field(default_factory=time.time)
    state: str = "firing"  # firing | resolved (the alert with the same key has cleared)
    gpu: Optional[int] = None  # the GPU (index) a per-GPU alert is about: part of its key
    # what identifies the GPUs concerned in the hardware: [{index, uuid, serial, pci_bus_id}] (see gpu_identities)
    gpus: list = field(default_factory=list)  # type: ignore[type-arg]
    scope: str = "node"  # node | job: a job-wide condition (one incident per job, whichever node reports it)
    dedup_key: Optional[str] = None  # an explicit stable key; default: see dedupe_key()
    partition: Optional[str] = None  # the Slurm partition(s) of the node or job, when the caller knows them
    keyword: Optional[str] = None  # the drain keyword (XID79, ECC, ...); default: parsed from `reason`
    component: Optional[str] = None  # a shared part at fault (leaf7): the page is about it, not about `node`
    component_kind: Optional[str] = None  # switch | rack | pdu | ... (gpuguard.slurm.components)

    @property
    def resolved(self) -> bool:
        return self.state == "resolved" or self.kind in RESOLVING_KINDS

    @property
    def family(self) -> str:
        return FAMILY.get(self.kind, self.kind)

    @property
    def key(self) -> str:
        return dedupe_key(self)


def key_part(text: str) -> str:
    """One component of a dedupe key: characters other than A-Za-z0-9_.:@+- become `_`."""
    return re.sub(r"[^A-Za-z0-9_.:@+-]", "_", str(text))[:100] or "_"


def dedupe_key(event: Event, prefix: str = "gpuguard") -> str:
    """The stable key of the incident an event belongs to: the same for its repeats and for its resolution,
    different for another node, GPU, check or job. `<prefix>/<node or jobJ>/<family>[/<check>][/gpuN][/jobJ]`
    (a drain is about the node: one per node at a time)."""
    if event.dedup_key:
        key = "/".join(key_part(p) for p in event.dedup_key.split("/"))
    else:
        fam = event.family
        job_scope = event.scope == "job" and bool(event.job_id)
        parts = [prefix, f"job{event.job_id}" if job_scope else event.node, fam]
        if fam != "drain" and not (job_scope and fam == "hang"):
            parts.append(event.check_id or "-")
        if event.gpu is not None and not job_scope and fam != "drain":  # a node's drain, whichever GPU
            parts.append(f"gpu{event.gpu}")
        if event.job_id and not job_scope and fam in JOB_FAMILIES:
            parts.append(f"job{event.job_id}")
        key = "/".join(key_part(p) for p in parts)
    if len(key) > MAX_KEY_LEN:
        key = key[:MAX_KEY_LEN - 17] + "~" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return key


def wanted(ncfg: NotifyConfig, event: Event, alertmanager: bool = False) -> bool:
    """Whether the config asks for this event at all (`notify.kinds`, `min_severity`). A resolution follows its
    alert whatever its own severity; for messages only with `send_resolved` (Alertmanager always gets it: an
    alert it is not told about stays firing until its endsAt, and its own `send_resolved` decides who hears)."""
    if event.kind not in ncfg.kinds:
        return False
    if event.resolved:
        return alertmanager or bool(ncfg.send_resolved)
    return SEVERITY_RANK.get(event.severity, 1) >= SEVERITY_RANK[ncfg.min_severity]
