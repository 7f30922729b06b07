"""What a check is: `CheckSpec` (a check's one home: its probe, run kinds, parameters, scope, priority, keywords,
reset evidence, runbook), `CheckInput` (what a check is given beside the observations) and the run-kind sets.

The registered checks are in `gpuguard.checks.registered`; the check modules import only this module, never the
package, so the registry can import them without an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from gpuguard.model import Finding, Observations
from gpuguard.util.record import Frozen, field, record, replace

if TYPE_CHECKING:
    from gpuguard.profiles import Profile
    from gpuguard.xid.catalog import XidCatalog

ALL_KINDS = frozenset({"prolog", "epilog", "healthcheck", "manual"})
# Node checks that are not about the job: the epilog adds them ("epilog_deep") only when the job died by a
# signal that can point at hardware (SIGKILL by the OOM killer aside, a SIGSEGV/SIGBUS is worth a look).
NODE = frozenset({"prolog", "healthcheck", "manual", "epilog_deep"})
# Right after a job the GPUs are hot and throttling is expected: not judged in the epilog.
IDLE_ONLY = frozenset({"prolog", "healthcheck", "manual"})
# The optional slow tier (single-node NCCL all_reduce, dcgmi diag): added to a prolog/manual run only when
# gpuguard.nccl.tier.tier_due() says so (config, exclusive job, first job after a reboot).
TIER = frozenset({"tier"})


@record
class CheckInput(Frozen):
    profile: "Profile"
    params: Mapping[str, Any] = field(default_factory=dict)
    job_gpus: Optional[tuple[int, ...]] = None  # None = all GPUs on the node
    kind: str = "manual"
    xid_catalog: Optional["XidCatalog"] = None
    unmapped_gpus: tuple[str, ...] = ()  # Slurm GPU ids that match no GPU NVML reports (gpuguard.pipeline.gpumap)
    gpu_map_notes: tuple[str, ...] = ()
    spec: Optional["CheckSpec"] = None  # the check being run (CheckSpec.__call__ sets it)


CheckFn = Callable[[Observations, CheckInput], list[Finding]]
# What a check needs its probe to read, from the check's parameters and the profile, e.g. {"with_processes": True}
ProbeOptionsFn = Callable[[Mapping[str, Any], "Profile"], Mapping[str, Any]]


@record
class CheckSpec(Frozen):
    id: str
    keywords: tuple[str, ...]  # drain keywords it may emit; the first is the default (XID covers XID79, ...)
    needs: str  # probe: nvml | kernel_log | fabric | system | nccl | dcgm | efa_counters
    func: CheckFn
    kinds: frozenset[str]
    params: dict[str, tuple[str, Any]]  # name -> (validator name in config.PARAM_VALIDATORS, default)
    description: str
    priority: int  # when several checks fail, the reason names the lowest number: root causes first
    # "node": every GPU of the node, whatever the job asked for (a row-remap failure drains the node whether or not
    # the job wanted that GPU); "job": the job's GPUs (temperature, clocks, leftover processes: another job's busy
    # GPUs would distort them)
    scope: str = "node"
    probe_options: Optional[ProbeOptionsFn] = None
    # Set when what it finds is cleared only by a GPU reset: the words for the evidence, when the state that failed
    # at drain time reads clear again ("the recovery action back to NONE"). Passing checks alone prove nothing.
    reset_evidence: Optional[str] = None
    # Its failure is unambiguous per-node hardware evidence (fatal Xid, GPU missing, uncorrectable ECC, row-remap
    # failure, a recovery action asking for a reset): judged even on built-in defaults when no configuration can be
    # read, and never held back by a fleet-wide drain guard. A mismatch finding (evidence mismatch=True) never is.
    hardware_evidence: bool = False
    runbook: str = ""  # anchor in docs/runbooks.md; "" = the check id

    @property
    def keyword(self) -> str:
        """The default keyword, for findings that do not name a more precise one."""
        return self.keywords[0]

    @property
    def runbook_anchor(self) -> str:
        return self.runbook or self.id

    def declares(self, keyword: str) -> bool:
        """May this check emit `keyword`? A numeric suffix counts as its base (XID79 -> XID)."""
        return keyword.rstrip("0123456789") in self.keywords

    def __call__(self, obs: Observations, inp: CheckInput) -> list[Finding]:
        """Run the function with its spec bound (`inp.spec`)."""
        return self.func(obs, inp if inp.spec is self else replace(inp, spec=self))
