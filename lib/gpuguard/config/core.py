"""The sections every hook run reads (the decision pipeline's own settings): node, policy, deadlines, sources,
locking, undrain, reboot, epilog, logging. They live here rather than beside one feature because the pipeline's
stages, the hooks, the watch daemon and the admin commands all read them (ARCHITECTURE.md, "config/").
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.config.fields import Section, boolean, choice, int_list, integer, key, mapping, number, section, string, \
    str_list


@section
class NodeConfig(Section):
    """`node:` which node this is and what hardware it should have."""

    # profile name, EC2 instance type, or "auto" (EC2 instance metadata, else "generic")
    profile: str = key(string(), "auto")
    profile_dir: Optional[str] = key(string(allow_none=True), None)
    overrides: dict[str, Any] = key(mapping, {})
    name: Optional[str] = key(string(allow_none=True), None)  # node name when not run by slurmd


@section
class PolicyConfig(Section):
    """`policy:` what a verdict does with what kind of evidence."""

    # a gpuguard bug or unreadable input: "open" = never drain for it (logged loudly), "closed" = drain
    on_internal_error: str = key(choice("open", "closed"), "open")
    # hardware evidence: "drain" (fail closed) or "report" (record and log only, e.g. a first rollout)
    on_failure: str = key(choice("drain", "report"), "drain")
    # a probe that could not finish (timeout, missing tool): "warn" or "drain"
    on_incomplete: str = key(choice("warn", "drain"), "warn")
    # ... but the same check incomplete this many runs in a row drains (0 = never)
    incomplete_escalate_after: int = key(integer(0), 3)
    # drain-storm guard: once this share of a partition (at least storm_min_nodes nodes) is drained for the
    # same check within storm_window_s, further drains for it page a human instead (never for unambiguous
    # hardware evidence: fatal Xid, GPU gone, uncorrectable ECC, row-remap failure, recovery action)
    storm_share: float = key(number(), 0.1)
    storm_min_nodes: int = key(integer(1), 2)
    storm_window_s: float = key(number(), 3600.0)


@section
class DeadlinesConfig(Section):
    """`deadlines:` seconds; every hook run, probe and scontrol call is bounded."""

    prolog_s: float = key(number(), 30.0)
    epilog_s: float = key(number(), 30.0)
    healthcheck_s: float = key(number(), 20.0)
    manual_s: float = key(number(), 60.0)
    nvml_s: float = key(number(), 10.0)
    kernel_log_s: float = key(number(), 5.0)
    fabric_s: float = key(number(), 5.0)
    system_s: float = key(number(), 5.0)
    scontrol_s: float = key(number(), 5.0)
    imds_s: float = key(number(), 1.0)

    def for_kind(self, kind: str) -> float:
        """The whole run's deadline for a run of `kind` (gpuguard.context.KINDS; any other: manual_s)."""
        return float({"prolog": self.prolog_s, "epilog": self.epilog_s, "healthcheck": self.healthcheck_s,
                      "manual": self.manual_s}.get(kind, self.manual_s))


@section
class SourcesConfig(Section):
    """`sources:` where a real node's probes read from."""

    kernel_log: str = key(string(), "auto")  # auto | kmsg[:PATH] | journal | dmesg | file:PATH
    sysfs_root: str = key(string(), "/sys")
    procfs_root: str = key(string(), "/proc")
    boot_id_path: str = key(string(), "/proc/sys/kernel/random/boot_id")
    fi_info: Optional[str] = key(string(allow_none=True), "fi_info")
    nvml_library: Optional[str] = key(string(allow_none=True), None)
    imds_endpoint: str = key(string(), "http://169.254.169.254")


@section
class LockingConfig(Section):
    """`locking:` runs on one node are serialised (prolog, epilog, health check)."""

    # a run that cannot get the lock in this time goes on read-only (no kernel-log cursor advance, no undrain)
    wait_s: float = key(number(), 5.0)


@section
class UndrainConfig(Section):
    """`undrain:` when the health check lifts gpuguard's own drains."""

    enabled: bool = key(boolean, True)
    passes: int = key(integer(1), 2)  # consecutive passing health-check runs of the check that drained the node
    replace: bool = key(boolean, False)  # auto-undrain hardware-inspection faults too (default: an admin does)
    max_undrains: int = key(integer(0), 3)  # more undrains than this within window_h: stays drained as FLAPPING
    window_h: float = key(number(), 24.0)
    # no longer used (kept so that existing configs stay valid): while a condition of the node stands, every hook
    # reads the node's own state from Slurm (gpuguard.pipeline.reconcile), never "known from the store"
    resync_s: float = key(number(0, strict=False), 3600.0)


@section
class RebootConfig(Section):
    """`reboot:` reboot-class faults."""

    # also ask Slurm to reboot the node when idle (`scontrol reboot ASAP nextstate=resume`; needs RebootProgram in
    # slurm.conf)
    auto: bool = key(boolean, False)
    escalate_after: int = key(integer(0), 2)  # same fault back after this many reboots: action replace
    window_days: float = key(number(), 30.0)


@section
class EpilogConfig(Section):
    """`epilog:` what the epilog does after a job."""

    kill_leftovers: bool = key(boolean, True)  # terminate the job user's processes left on its GPUs
    kill_grace_s: float = key(number(), 5.0)  # SIGTERM, this long, then SIGKILL
    # a job that died with one of these codes (128+signal: SIGABRT, SIGBUS, SIGKILL, SIGSEGV) gets the
    # health check's deeper set of checks in its epilog
    deep_on_exit_codes: list[int] = key(int_list, [134, 135, 137, 139])
    # node-local roots where jobs create their private gpuguard-<jobid> scratch (the torchrun template's
    # local_dir); the epilog removes the job's directories there (gpuguard.pipeline.jobscratch: owner-checked, no
    # links)
    scratch_dirs: list[str] = key(str_list, ["/tmp"])


@section
class LoggingConfig(Section):
    """`logging:` where gpuguard's own log lines go."""

    syslog: bool = key(boolean, True)
    file: Optional[str] = key(string(allow_none=True), None)
    level: str = key(choice("debug", "info", "warning", "error"), "info")
