"""Site configuration: `/etc/gpuguard/config.yaml` (or `--config` / `$GPUGUARD_CONFIG`).

Validated against a schema; an error names the key path *and* the line, e.g.
``/etc/gpuguard/config.yaml: line 7: deadlines.prolog_s: expected a number > 0, got 'soon'``.
Every check can be switched off fleet-wide (`checks.<id>.enabled: false`) without a redeploy.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from gpuguard.config.yamlutil import Located

DEFAULT_CONFIG_PATH = "/etc/gpuguard/config.yaml"
ENV_CONFIG = "GPUGUARD_CONFIG"


class ConfigError(ValueError):
    """Bad configuration. The message names the file, the line and the key."""


# --------------------------------------------------------------------------- schema primitives

Validator = Callable[[Any], Any]  # returns the normalised value or raises ValueError(msg)


def _num(minimum: float = 0.0, strict: bool = True, allow_none: bool = False) -> Validator:
    def v(x: Any) -> Any:
        if x is None and allow_none:
            return None
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"expected a number{' or null' if allow_none else ''}, got {x!r}")
        if not math.isfinite(x):  # YAML's .nan / .inf: a deadline of infinity is no deadline at all
            raise ValueError(f"expected a finite number, got {x!r}")
        if (x <= minimum) if strict else (x < minimum):
            raise ValueError(f"expected a number {'>' if strict else '>='} {minimum:g}, got {x!r}")
        return x

    return v


def _int(minimum: int = 0, allow_none: bool = False) -> Validator:
    def v(x: Any) -> Any:
        if x is None and allow_none:
            return None
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"expected an integer{' or null' if allow_none else ''}, got {x!r}")
        if x < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {x!r}")
        return x

    return v


def _bool(x: Any) -> Any:
    if not isinstance(x, bool):
        raise ValueError(f"expected true or false, got {x!r}")
    return x


def _str(allow_none: bool = False) -> Validator:
    def v(x: Any) -> Any:
        if x is None and allow_none:
            return None
        if not isinstance(x, str) or not x:
            raise ValueError(f"expected a non-empty string{' or null' if allow_none else ''}, got {x!r}")
        return x

    return v


def _choice(*choices: str) -> Validator:
    def v(x: Any) -> Any:
        if x not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {x!r}")
        return x

    return v


def _str_list(x: Any) -> Any:
    if not isinstance(x, list) or not all(isinstance(i, str) and i for i in x):
        raise ValueError(f"expected a list of strings, got {x!r}")
    return list(x)


def _int_list(x: Any) -> Any:
    if not isinstance(x, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        raise ValueError(f"expected a list of integers, got {x!r}")
    return list(x)


def _any_mapping(x: Any) -> Any:
    if not isinstance(x, dict):
        raise ValueError(f"expected a mapping, got {x!r}")
    return x


def _disk_paths(x: Any) -> Any:
    """sys.disk paths: [{path, min_free_gib, root_owned}]; `root_owned: true` (only root writes there) is
    what lets a full filesystem drain the node."""
    if not isinstance(x, list):
        raise ValueError(f"expected a list of {{path, min_free_gib, root_owned}}, got {x!r}")
    out = []
    for i, item in enumerate(x):
        if not isinstance(item, dict) or set(item) - {"path", "min_free_gib", "root_owned"} or "path" not in item:
            raise ValueError(f"item {i}: expected {{path: ..., min_free_gib: ..., root_owned: ...}}, got {item!r}")
        if not isinstance(item["path"], str) or not item["path"].startswith("/"):
            raise ValueError(f"item {i}: path must be absolute, got {item['path']!r}")
        _num(0, strict=False)(item.get("min_free_gib", 1))
        if not isinstance(item.get("root_owned", False), bool):
            raise ValueError(f"item {i}: root_owned must be true or false, got {item['root_owned']!r}")
        out.append({"path": item["path"], "min_free_gib": item.get("min_free_gib", 1),
                    "root_owned": item.get("root_owned", False)})
    return out


def _pg_url(x: Any) -> Any:
    """store.url; gpuguard.fleet.url is imported only when a url is configured (the hooks stay lean)."""
    if x is None:
        return None
    from gpuguard.fleet.url import validate_url

    return validate_url(x)


def _secret_list(x: Any) -> Any:
    """notify.urls: a list of strings; an error never quotes them (apprise URLs carry tokens)."""
    if not isinstance(x, list) or not all(isinstance(i, str) and i for i in x):
        raise ValueError(f"expected a list of non-empty URL strings, got a {type(x).__name__} (value not shown: "
                         "it may hold tokens)")
    return list(x)


def _alertmanager_urls(x: Any) -> Any:
    """notify.alertmanager_urls: http(s) URLs naming a host; errors show them with passwords masked."""
    from urllib.parse import urlsplit

    from gpuguard.util.redact import redact_url

    for url in _secret_list(x):
        try:
            u = urlsplit(url.strip())
            u.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:  # urlsplit's message may quote a piece of the URL
            raise ValueError(f"not a valid URL (host or port does not parse): {redact_url(url)}") from None
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            raise ValueError(f"expected http(s)://HOST:PORT[/prefix] (no query), got {redact_url(url)}")
    return [u.strip() for u in x]


# keys that existed once: a clear word instead of "unknown key"
REMOVED_KEYS = {
    "notify.shared_dir": "removed: fleet-wide grouping is Alertmanager's job now (notify.alertmanager_urls and "
                         "observability/alertmanager.yml; docs/alerts.md)",
    "notify.group_threshold": "removed with notify.shared_dir (Alertmanager groups alerts: docs/alerts.md)",
    "notify.group_window_s": "removed with notify.shared_dir (Alertmanager's group_wait/group_interval)",
    "notify.trusted_user": "removed: root trusts only root-owned notification state (docs/alerts.md)",
}


# Sections with fixed keys: key -> (validator, default)
SCHEMA: dict[str, dict[str, tuple[Validator, Any]]] = {
    "node": {
        # profile name, EC2 instance type, or "auto" (EC2 instance metadata, else "generic")
        "profile": (_str(), "auto"),
        "profile_dir": (_str(allow_none=True), None),
        "overrides": (_any_mapping, {}),
        "name": (_str(allow_none=True), None),  # node name when not run by slurmd
    },
    "policy": {
        # a gpuguard bug or unreadable input: "open" = never drain for it (logged loudly), "closed" = drain
        "on_internal_error": (_choice("open", "closed"), "open"),
        # hardware evidence: "drain" (fail closed) or "report" (record and log only, e.g. a first rollout)
        "on_failure": (_choice("drain", "report"), "drain"),
        # a probe that could not finish (timeout, missing tool): "warn" or "drain"
        "on_incomplete": (_choice("warn", "drain"), "warn"),
        # ... but the same check incomplete this many runs in a row drains (0 = never)
        "incomplete_escalate_after": (_int(0), 3),
        # drain-storm guard: once this share of a partition (at least storm_min_nodes nodes) is drained for the
        # same check within storm_window_s, further drains for it page a human instead (never for unambiguous
        # hardware evidence: fatal Xid, GPU gone, uncorrectable ECC, row-remap failure, recovery action)
        "storm_share": (_num(), 0.1),
        "storm_min_nodes": (_int(1), 2),
        "storm_window_s": (_num(), 3600.0),
    },
    "deadlines": {
        "prolog_s": (_num(), 30.0),
        "epilog_s": (_num(), 30.0),
        "healthcheck_s": (_num(), 20.0),
        "manual_s": (_num(), 60.0),
        "nvml_s": (_num(), 10.0),
        "kernel_log_s": (_num(), 5.0),
        "fabric_s": (_num(), 5.0),
        "system_s": (_num(), 5.0),
        "scontrol_s": (_num(), 5.0),
        "imds_s": (_num(), 1.0),
    },
    "sources": {
        "kernel_log": (_str(), "auto"),  # auto | kmsg[:PATH] | journal | dmesg | file:PATH
        "sysfs_root": (_str(), "/sys"),
        "procfs_root": (_str(), "/proc"),
        "boot_id_path": (_str(), "/proc/sys/kernel/random/boot_id"),
        "fi_info": (_str(allow_none=True), "fi_info"),
        "nvml_library": (_str(allow_none=True), None),
        "imds_endpoint": (_str(), "http://169.254.169.254"),
    },
    "store": {
        # SQLite history; "{node}" is replaced by the node name (several slurmd on one host)
        "path": (_str(), "/var/lib/gpuguard/state.db"),
        # central history (gpuguard.fleet): postgresql://USER@HOST[:PORT]/DB, the password in ~/.pgpass or
        # $PGPASSFILE rather than here; hooks record locally and ship asynchronously; null = SQLite only
        "url": (_pg_url, None),
        # local runs/findings/drains older than this are pruned by the health check (never less than
        # reboot.window_days; never rows not yet shipped to store.url); null = keep everything
        "retention_days": (_num(allow_none=True), 90.0),
        "ship_budget_s": (_num(), 2.0),  # the health check ships and prunes for at most this long after its verdict
        "ship_interval_s": (_num(), 60.0),  # how often the watch daemon ships
        # the verdict journal (pending drains, kernel-log positions): a tmpfs by default, so a full, read-only or
        # damaged store filesystem never loses a verdict or skips evidence; null = $GPUGUARD_RUNTIME_DIR (set in
        # gpuguard.env beside the hooks) or /run/gpuguard
        "runtime_dir": (_str(allow_none=True), None),
        # central history (store.url): `gpuguard fleet prune` drops months that ended longer ago than this (whole
        # months: up to a month more is kept); null = keep everything
        "fleet_retention_days": (_num(allow_none=True), 400.0),
    },
    "slurm": {
        "backend": (_choice("auto", "cli", "pyslurm"), "auto"),
        "scontrol": (_str(), "scontrol"),
        "conf": (_str(allow_none=True), None),  # slurm.conf for scontrol when the caller's env has no SLURM_CONF
        # what the integers in SLURM_JOB_GPUS are: "minor" = GRES index = /dev/nvidiaN minor number (gres.conf
        # File=/dev/nvidia[0-7] and AutoDetect=nvml), "nvml_index" = NVML's index (a gres.conf written that way)
        "gpu_ids": (_choice("minor", "nvml_index"), "minor"),
    },
    "xid": {
        "overrides": (_any_mapping, {}),
    },
    "simulation": {
        # a scenario file, or a directory holding <node>.yaml (falls back to default.yaml)
        "scenario": (_str(allow_none=True), None),
        "scenario_dir": (_str(allow_none=True), None),
        "fake_nvml": (_str(allow_none=True), None),
        "workdir": (_str(allow_none=True), None),
        # the simulated node's tools for the optional tier: {all_reduce_perf: PATH, dcgmi: PATH} (simulated
        # nccl-tests/dcgmi that read the scenario: devtools.nccl_tests_stub, installed by the dev site)
        "tools": (_any_mapping, {}),
    },
    "locking": {
        # runs on one node are serialised (prolog, epilog, health check); a run that cannot get the lock in
        # this time goes on read-only (no kernel-log cursor advance, no undrain)
        "wait_s": (_num(), 5.0),
    },
    "undrain": {
        "enabled": (_bool, True),
        "passes": (_int(1), 2),  # consecutive passing health-check runs of the check that drained the node
        "replace": (_bool, False),  # auto-undrain hardware-inspection faults too (default: an admin does)
        "max_undrains": (_int(0), 3),  # more undrains than this within window_h: stays drained as FLAPPING
        "window_h": (_num(), 24.0),
        # a node gpuguard keeps drained costs slurmctld nothing per health check; its state is read again at most
        # this often (an admin may have resumed it)
        "resync_s": (_num(0, strict=False), 3600.0),
    },
    "reboot": {
        # reboot-class faults: also ask Slurm to reboot the node when idle (`scontrol reboot ASAP
        # nextstate=resume`; needs RebootProgram in slurm.conf)
        "auto": (_bool, False),
        "escalate_after": (_int(0), 2),  # same fault back after this many reboots: action replace
        "window_days": (_num(), 30.0),
    },
    "epilog": {
        "kill_leftovers": (_bool, True),  # terminate the job user's processes left on its GPUs
        "kill_grace_s": (_num(), 5.0),  # SIGTERM, this long, then SIGKILL
        # a job that died with one of these codes (128+signal: SIGABRT, SIGBUS, SIGKILL, SIGSEGV) gets the
        # health check's deeper set of checks in its epilog
        "deep_on_exit_codes": (_int_list, [134, 135, 137, 139]),
        # node-local roots where jobs create their private gpuguard-<jobid> scratch (the torchrun template's
        # local_dir); the epilog removes the job's directories there (gpuguard.pipeline.jobscratch: owner-checked, no links)
        "scratch_dirs": (_str_list, ["/tmp"]),
    },
    # Feature sections are inserted at their marker (one per feature owner), keep the markers.
    # @section:watch
    "watch": {
        # kernel log the watch daemon follows; null = sources.kernel_log (on a simulated node: its kmsg file)
        "source": (_str(allow_none=True), None),
        # first start (no cursor yet): "boot" judges this boot's whole kernel log, "end" only new lines,
        # "auto" = boot for kmsg/journal, end for a text file (it spans boots: old lines are not this boot's)
        "start_at": (_choice("auto", "boot", "end"), "auto"),
        "dedupe_window_s": (_num(), 300.0),  # the same Xid code on the same GPU within this is one event
        "poll_interval_s": (_num(), 0.25),  # file sources only: how often to look for new lines
        "retry_initial_s": (_num(), 1.0),  # a drain that failed (scontrol down) is retried after this, doubling
        "retry_max_s": (_num(), 60.0),  # ... up to this, until it goes through
        "record_non_fatal": (_bool, True),  # record app/warn-class Xids (folded by the dedupe window) in history
    },
    # @section:templates
    "templates": {
        # a directory searched before the shipped sbatch_templates/ (site templates of the same name win)
        "dir": (_str(allow_none=True), None),
        # site defaults for template variables, e.g. {max_failures: 3, no_retry_exit_codes: [2],
        # checkpoint_glob: "step-*", preset: p5.48xlarge, gpuguard: /usr/local/bin/gpuguard}; a job's own
        # values win; checked against each template's declared variables when rendering
        "defaults": (_any_mapping, {}),
        # preset overrides/additions merged over the shipped presets: {instances: {...}, stacks: {...},
        # common: {env: [{name, value, why}]}, known_bad: [...]}; validated when used
        "presets": (_any_mapping, {}),
        # the user side's own SQLite file for job attempts (`gpuguard job-attempt`, run by the job as its user;
        # `gpuguard history` reads it): "{user}" = the job's user, "{node}" = the batch host, e.g.
        # /shared/gpuguard/attempts-{user}.db. Never the hooks' store.path (refused at run time): the root hooks'
        # database must not be writable by users. Unset: only the ledger in the job directory.
        "store_path": (_str(allow_none=True), None),
    },
    # @section:nccl
    "nccl": {
        # optional prolog tier (single-node all_reduce + dcgmi diag + EFA counter deltas); see docs/nccl.md
        "tier_enabled": (_bool, False),
        "only_exclusive": (_bool, True),  # only jobs given every GPU of the node (22.05: no SLURM_JOB_EXCLUSIVE)
        "first_job_after_reboot": (_bool, True),  # once per boot (false: every exclusive job)
        "tier_interval_h": (_num(0, strict=False), 0.0),  # ... and again after this many hours (0 = never)
        "binary": (_str(), "all_reduce_perf"),  # nccl-tests all_reduce_perf (path or name on PATH)
        "fallback": (_choice("none", "torch"), "none"),  # nccl-tests missing: torch.distributed probe instead
        "min_bytes": (_int(4), 536870912),
        "max_bytes": (_int(4), 4294967296),
        "iterations": (_int(1), 20),
        "timeout_s": (_num(), 120.0),
        "dcgmi": (_str(allow_none=True), "dcgmi"),  # null = no DCGM diagnostics in the tier
        "dcgm_level": (_int(1), 1),  # dcgmi diag -r N (1 quick, 2 medium, 3/4 long)
        "dcgm_timeout_s": (_num(), 300.0),
        # fleet sweep (gpuguard nccl sweep); thresholds per node count win over the single figure
        "sweep_busbw_gbps": (_num(allow_none=True), None),
        "sweep_busbw_by_nodes": (_any_mapping, {}),  # {2: 380, 16: 350}: node count -> GB/s
        "sweep_method": (_choice("pairwise", "bisect"), "pairwise"),
        "sweep_gpus_per_node": (_int(1), 8),
        "sweep_min_bytes": (_int(4), 1073741824),
        "sweep_max_bytes": (_int(4), 17179869184),
        "sweep_iterations": (_int(1), 20),
        "sweep_time_limit": (_str(), "00:15:00"),
        "sweep_job_timeout_s": (_num(), 1800.0),
        "sweep_binary": (_str(allow_none=True), None),  # path on the compute nodes (default: binary)
        "sweep_preset": (_str(allow_none=True), None),  # NCCL environment preset of the nccl-tests template
        "sweep_mpi": (_choice("pmix", "pmi2", "none"), "pmix"),  # srun --mpi for the (MPI=1) nccl-tests build
        "sweep_drain": (_bool, True),
        "sweep_max_drain_fraction": (_num(), 0.5),  # more slow nodes than this: fabric problem, drain nothing
        "sweep_workdir": (_str(allow_none=True), None),  # scripts + outputs, shared FS (default: by the store)
        "history_path": (_str(allow_none=True), None),  # sweep/baseline store (default: store.path, {node}=fleet)
        # baselines (gpuguard baseline): threshold = median - max(k * 1.4826 * MAD, margin_pct% of median)
        "baseline_min_samples": (_int(1), 5),
        "baseline_k": (_num(), 3.0),
        "baseline_margin_pct": (_num(0, strict=False), 5.0),
    },
    # @section:notify
    "notify": {
        # apprise URLs (json://, slack://, mailto://, sns://, ...); none = apprise off, nothing imported
        "urls": (_secret_list, []),
        # Alertmanager(s) gpuguard posts its alerts to (POST /api/v2/alerts): every URL gets every alert (an HA
        # pair: list both). http(s)://[user:password@]HOST:PORT[/route-prefix]
        "alertmanager_urls": (_alertmanager_urls, []),
        "cluster": (_str(allow_none=True), None),  # the `cluster` label of every alert (several clusters, one AM)
        "runbook_url": (_str(allow_none=True), None),  # base URL of docs/runbooks.md: annotation <url>#<check>
        # a firing alert is re-posted by flush() at most this often; it ends by itself alertmanager_ttl_s after the
        # last post (null: 4x the longer of this and metrics.healthcheck_interval_s)
        "alertmanager_resend_s": (_num(), 60.0),
        "alertmanager_ttl_s": (_num(allow_none=True), None),
        "min_severity": (_choice("info", "warning", "critical"), "info"),
        "kinds": (_str_list, ["drain", "undrain", "prolog_failure", "straggler", "hang", "requeue",
                              "internal_error", "flapping", "resource", "unknown_xid", "storm", "mismatch",
                              "gave_up"]),  # resource: monitor thresholds
        # one message per episode (node/GPU + check, until resolved); an episode nothing has repeated or resolved
        # for this long is over (the fallback for alerts that never resolve)
        "dedup_window_s": (_num(0, strict=False), 3600.0),
        "send_resolved": (_bool, True),  # a "resolved" message with the alert's dedup key when it clears
        # at most rate_limit messages per rate_window_s from one state file; the rest go out as one digest
        "rate_limit": (_int(1), 10),
        "rate_window_s": (_num(), 600.0),
        "state_path": (_str(allow_none=True), None),  # SQLite spool + limiter state (default: store.path)
        # the monitor's (run as the job's user) own state; {job_dir} {job_id} {node} {uid}; null =
        # {job_dir}/gpuguard/notify/{node}.db. It never uses state_path or store.path
        "user_state_path": (_str(allow_none=True), None),
        "timeout_s": (_num(), 5.0),  # one delivery attempt to one URL
        "spool_max_age_h": (_num(), 72.0),  # undeliverable messages are retried by flush() this long
        "title_prefix": (_str(), "gpuguard"),
    },
    # @section:metrics
    "metrics": {
        # node_exporter --collector.textfile.directory ("{node}" = node name); null = no metrics, no cost
        "textfile_dir": (_str(allow_none=True), None),
        # slurm.conf HealthCheckInterval, exported so the freshness alert fires after 3x this without a health check
        "healthcheck_interval_s": (_num(), 300.0),
        # how often `gpuguard watch` writes its liveness heartbeat (the "watch down" alert waits 3x this)
        "watch_heartbeat_s": (_num(), 30.0),
    },
    # @section:monitor
    "monitor": {
        "interval_s": (_num(), 10.0),
        # node thresholds (CloudWatch alarm practice: above 80-90 % for 5 minutes); null = not checked
        "cpu_percent_max": (_num(0, strict=False, allow_none=True), 90.0),
        "memory_percent_max": (_num(0, strict=False, allow_none=True), 90.0),
        "disk_percent_max": (_num(0, strict=False, allow_none=True), 90.0),
        "disk_paths": (_str_list, ["/", "/tmp"]),
        "sustain_s": (_num(0, strict=False), 300.0),  # a node threshold must hold this long before it alerts
        # GPU thresholds; gpu_temp_max_c null = 5 C below the GPU's own slowdown temperature
        "gpu_temp_max_c": (_num(0, strict=False, allow_none=True), None),
        "gpu_power_max_w": (_num(0, strict=False, allow_none=True), None),
        "gpu_memory_percent_max": (_num(0, strict=False, allow_none=True), None),
        "ecc_uncorrected_max": (_int(0), 0),  # volatile uncorrected ECC errors gained during the job
        "throttle": (_bool, True),  # alert on HW slowdown / HW thermal / power brake / SW thermal
        # stragglers, compared with the job's other GPUs and nodes (reports in the shared job directory)
        "straggler_clock_ratio": (_num(), 0.85),  # SM clock below 85 % of the job's median while busy
        "straggler_util_gap_pct": (_num(), 25.0),  # utilisation this many points below the job's median
        "straggler_step_ratio": (_num(), 1.2),  # step time 20 % above the other nodes' median
        "straggler_samples": (_int(1), 3),  # consecutive samples before a straggler alert
        "busy_util_pct": (_num(0, strict=False), 50.0),  # a GPU counts as busy (clocks comparable) above this
        # hangs: no new iteration in the training log, or every GPU idle, for this long
        "hang_minutes": (_num(), 15.0),
        "startup_minutes": (_num(), 30.0),  # allowance before the first iteration appears
        "idle_minutes": (_num(), 10.0),
        "idle_util_pct": (_num(0, strict=False), 1.0),
        # the training log: "auto" = <job dir>/train.log, else the job's StdOut from `scontrol show job`;
        # "{job_dir}", "{job_id}", "{node}" are substituted; null = hang detection from GPU idleness only
        "train_log": (_str(allow_none=True), "auto"),
        "py_spy": (_str(allow_none=True), "py-spy"),  # null = never dump stacks
        "requeue_on_hang": (_bool, False),
        # how to requeue: by default the torchrun template's own USR1 trap (checkpoint, ledger, max requeues)
        "requeue_command": (_str_list, ["scancel", "--batch", "--signal=USR1", "{job_id}"]),
        "command_timeout_s": (_num(), 20.0),
    },
    "logging": {
        "syslog": (_bool, True),
        "file": (_str(allow_none=True), None),
        "level": (_choice("debug", "info", "warning", "error"), "info"),
    },
}

# Parameters every check accepts, plus per-check parameters (defaults live with the check registry).
COMMON_CHECK_PARAMS: dict[str, tuple[Validator, Any]] = {
    "enabled": (_bool, True),
}

PARAM_VALIDATORS: dict[str, Validator] = {
    "int": _int(0),
    "int?": _int(0, allow_none=True),
    "num": _num(0, strict=False),
    "num?": _num(0, strict=False, allow_none=True),
    "bool": _bool,
    "str?": _str(allow_none=True),
    "strlist": _str_list,
    "disk_paths": _disk_paths,
    "action": _choice("drain", "reset", "reboot", "replace"),
    "severity": _choice("fail", "warn"),
}


@dataclass(frozen=True)
class ConfigIssue:
    """One thing wrong in a config file: the key path (or "(file)"), its line when known, what is wrong."""

    path: str
    line: Optional[int]
    message: str
    meant: Optional[str] = None  # for an unknown key: the known key it most likely misspells (full path)

    def __str__(self) -> str:
        return f"{'line ' + str(self.line) + ': ' if self.line else ''}{self.path}: {self.message}"


@dataclass
class Config:
    source: str = "<defaults>"
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)  # check id -> params given in config
    # What was wrong with the file this config stands in for (gpuguard.config.lastgood): "ok", "partial" (bad keys took
    # their last good value), "last-good" (the file could not be used: the last config that validated), or
    # "defaults" (nothing usable: built-in defaults, and only unambiguous hardware evidence drains).
    mode: str = "ok"
    issues: list[ConfigIssue] = field(default_factory=list)
    last_good_at: Optional[float] = None  # when the configuration used for the bad parts was validated
    given: set[str] = field(default_factory=set)  # key paths the file set validly ("deadlines.prolog_s", ...)

    @property
    def restricted(self) -> bool:
        return self.mode == "defaults"

    def get(self, section: str, key: str) -> Any:
        return self.sections[section][key]

    def check_enabled(self, check_id: str) -> bool:
        return bool(self.checks.get(check_id, {}).get("enabled", True))

    def check_params(self, check_id: str, defaults: dict[str, Any]) -> dict[str, Any]:
        params = dict(defaults)
        params.update({k: v for k, v in self.checks.get(check_id, {}).items() if k != "enabled"})
        return params


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _err(source: str, line: Optional[int], path: str, msg: str) -> ConfigError:
    where = f"line {line}: " if line else ""
    return ConfigError(f"{source}: {where}{path}: {msg}")


class _Issues:
    """Strict (the default): the first problem raises ConfigError naming file, line and key. Lenient: every
    problem is collected and its key left at its default, so one bad key never discards the rest of the file."""

    def __init__(self, source: str, lenient: bool) -> None:
        self.source = source
        self.lenient = lenient
        self.found: list[ConfigIssue] = []

    def report(self, line: Optional[int], path: str, msg: str, meant: Optional[str] = None) -> None:
        if not self.lenient:
            raise _err(self.source, line, path, msg)
        self.found.append(ConfigIssue(path, line, msg, meant))


def _closest(key: str, options: list[str]) -> Optional[str]:
    close = difflib.get_close_matches(key, options, n=1)
    return close[0] if close else None


def default_config(source: str = "<defaults>") -> Config:
    cfg = Config(source=source)
    for section, keys in SCHEMA.items():
        cfg.sections[section] = {k: (dict(d) if isinstance(d, dict) else list(d) if isinstance(d, list) else d)
                                 for k, (_, d) in keys.items()}
    return cfg


def parse_config(text: str, source: str = "<string>", check_params: Optional[dict[str, dict[str, str]]] = None,
                 lenient: bool = False) -> Config:
    """Validate YAML text into a Config. `check_params`: check id -> {param: validator name}. `lenient`: collect
    every problem in `Config.issues` instead of raising at the first (a file that is not YAML, or not a mapping,
    still raises: there are no keys to keep)."""
    from gpuguard.config.yamlutil import Located, YamlError, load_yaml_located  # only when a file is really parsed

    if check_params is None:
        from gpuguard.checks import param_schema

        check_params = param_schema()
    try:
        check_yaml_expansion(text, source)
        root = load_yaml_located(text, source)
    except YamlError as e:
        raise ConfigError(str(e)) from None
    cfg = default_config(source)
    if root is None:
        return cfg
    if not isinstance(root, Located):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    issues = _Issues(source, lenient)
    allowed = sorted(list(SCHEMA) + ["checks"])
    for section, value in root.value.items():
        line = root.lines.get(str(section))
        if section not in allowed:
            issues.report(line, str(section), f"unknown section{_suggest(str(section), allowed)}; known: "
                          f"{', '.join(allowed)}")
        elif value is None:
            continue
        elif not isinstance(value, Located):
            issues.report(line, str(section), "expected a mapping")
        elif section == "checks":
            _parse_checks(cfg, value, issues, check_params)
        else:
            _parse_section(cfg, str(section), value, issues)
    _parse_xid_overrides(cfg, root, issues)
    cfg.issues = issues.found
    cfg.mode = "partial" if issues.found else "ok"
    return cfg


def _parse_section(cfg: Config, section: str, value: Located, issues: _Issues) -> None:
    from gpuguard.config.yamlutil import strip_located

    schema = SCHEMA[section]
    for key, raw in value.value.items():
        kline = value.lines.get(str(key))
        path = f"{section}.{key}"
        if path in REMOVED_KEYS:
            issues.report(kline, path, REMOVED_KEYS[path])
            continue
        if key not in schema:
            meant = _closest(str(key), list(schema))
            issues.report(kline, path, f"unknown key{_suggest(str(key), list(schema))}; known: {', '.join(schema)}",
                          f"{section}.{meant}" if meant else None)
            continue
        validator, _ = schema[key]
        try:
            cfg.sections[section][key] = validator(strip_located(raw))
            cfg.given.add(path)
        except ValueError as e:
            issues.report(kline, path, str(e))


MAX_YAML_NODES = 100_000  # a real config has a few hundred; "billion laughs" aliases expand to billions


def check_yaml_expansion(text: str, source: str, limit: int = MAX_YAML_NODES) -> None:
    """Refuse YAML whose aliases expand to more than `limit` nodes (a "billion laughs" document is a few hundred
    bytes, expands exponentially and would hang the prolog). Counted on the composed node graph, where an alias
    is the same node object again: linear in the document, iterative (no recursion limit)."""
    import yaml

    from gpuguard.config.yamlutil import YamlError

    if "*" not in text:  # no alias, nothing can expand: skip the second compose on the prolog's path
        return
    loader_cls = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        loader = loader_cls(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError:
        return  # the real parse reports the error with its line
    if root is None:
        return
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        if isinstance(node, yaml.MappingNode):
            kids = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            kids = list(node.value)
        else:
            kids = []
        if children_done or not kids:
            total = 1 + sum(size.get(id(k), 0) for k in kids)
            if total > limit:
                line = node.start_mark.line + 1
                raise YamlError(f"{source}: line {line}: document expands to more than {limit} nodes through "
                                f"aliases (&anchor/*alias): refused")
            size[id(node)] = total
            continue
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)


def _parse_checks(cfg: Config, node: Located, issues: _Issues, check_params: dict[str, dict[str, str]]) -> None:
    from gpuguard.config.yamlutil import Located, strip_located

    known = sorted(check_params)
    for check_id, raw in node.value.items():
        line = node.lines.get(str(check_id))
        path = f"checks.{check_id}"
        if check_id not in check_params:
            issues.report(line, path, f"unknown check{_suggest(str(check_id), known)}")
            continue
        if isinstance(raw, bool):  # shorthand: `gpu.nvlink: false`
            cfg.checks[check_id] = {"enabled": raw}
            continue
        if raw is None:
            continue
        if not isinstance(raw, Located):
            issues.report(line, path, "expected a mapping of parameters or true/false")
            continue
        params: dict[str, Any] = {}
        spec = {**{k: "bool" for k in COMMON_CHECK_PARAMS}, **check_params[check_id]}
        for key, value in raw.value.items():
            kline = raw.lines.get(str(key))
            if key not in spec:
                meant = _closest(str(key), list(spec))
                issues.report(kline, f"{path}.{key}", f"unknown parameter{_suggest(str(key), list(spec))}; known: "
                              f"{', '.join(sorted(spec))}", f"{path}.{meant}" if meant else None)
                continue
            try:
                params[key] = PARAM_VALIDATORS[spec[key]](strip_located(value))
                cfg.given.add(f"{path}.{key}")
            except ValueError as e:
                issues.report(kline, f"{path}.{key}", str(e))
        cfg.checks[check_id] = params


def _parse_xid_overrides(cfg: Config, root: Located, issues: _Issues) -> None:
    from gpuguard.config.yamlutil import Located

    overrides = cfg.sections["xid"]["overrides"]
    if not overrides:
        return
    xid_node = root.value.get("xid")
    line = xid_node.lines.get("overrides") if isinstance(xid_node, Located) else None
    normalised: dict[Any, dict[str, Any]] = {}
    for code, value in overrides.items():
        if code != "unknown" and (isinstance(code, bool) or not isinstance(code, int)):
            issues.report(line, f"xid.overrides.{code}", "keys must be Xid codes (integers) or 'unknown'")
        elif not isinstance(value, dict):
            issues.report(line, f"xid.overrides.{code}", "expected a mapping like {severity: fatal, action: reboot}")
        else:
            normalised[code] = value
    try:
        from gpuguard.xid.catalog import load_catalog

        load_catalog(overrides=normalised)
    except (ValueError, KeyError) as e:
        issues.report(line, "xid.overrides", str(e))
        normalised = {}
    cfg.sections["xid"]["overrides"] = normalised


def config_path(explicit: Optional[str] = None) -> tuple[str, bool]:
    """(path, must_exist): an explicit path or $GPUGUARD_CONFIG must exist; the default may be absent."""
    if explicit:
        return explicit, True
    env = os.environ.get(ENV_CONFIG)
    if env:
        return env, True
    return DEFAULT_CONFIG_PATH, False


def load_config(explicit: Optional[str] = None) -> Config:
    path, must_exist = config_path(explicit)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if must_exist:
            raise ConfigError(f"{path}: config file not found") from None
        return parse_config("", source=f"{path} (absent: defaults)")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    return parse_config(text, source=path)
