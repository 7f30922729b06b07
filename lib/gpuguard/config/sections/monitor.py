"""The `monitor:` section: the per-job sidecar's thresholds (gpuguard.monitor)."""

from __future__ import annotations

from typing import Optional

from gpuguard.config.fields import Section, boolean, integer, key, number, section, str_list, string


@section
class MonitorConfig(Section):
    """`monitor:` what the sidecar samples, and when it alerts, dumps stacks or requeues."""

    interval_s: float = key(number(), 10.0)
    # node thresholds (CloudWatch alarm practice: above 80-90 % for 5 minutes); null = not checked
    cpu_percent_max: Optional[float] = key(number(0, strict=False, allow_none=True), 90.0)
    memory_percent_max: Optional[float] = key(number(0, strict=False, allow_none=True), 90.0)
    disk_percent_max: Optional[float] = key(number(0, strict=False, allow_none=True), 90.0)
    disk_paths: list[str] = key(str_list, ["/", "/tmp"])
    sustain_s: float = key(number(0, strict=False), 300.0)  # a node threshold must hold this long before it alerts
    # GPU thresholds; gpu_temp_max_c null = 5 C below the GPU's own slowdown temperature
    gpu_temp_max_c: Optional[float] = key(number(0, strict=False, allow_none=True), None)
    gpu_power_max_w: Optional[float] = key(number(0, strict=False, allow_none=True), None)
    gpu_memory_percent_max: Optional[float] = key(number(0, strict=False, allow_none=True), None)
    ecc_uncorrected_max: int = key(integer(0), 0)  # volatile uncorrected ECC errors gained during the job
    throttle: bool = key(boolean, True)  # alert on HW slowdown / HW thermal / power brake / SW thermal
    # stragglers, compared with the job's other GPUs and nodes (reports in the shared job directory)
    straggler_clock_ratio: float = key(number(), 0.85)  # SM clock below 85 % of the job's median while busy
    straggler_util_gap_pct: float = key(number(), 25.0)  # utilisation this many points below the job's median
    straggler_step_ratio: float = key(number(), 1.2)  # step time 20 % above the other nodes' median
    straggler_samples: int = key(integer(1), 3)  # consecutive samples before a straggler alert
    busy_util_pct: float = key(number(0, strict=False), 50.0)  # a GPU counts as busy (clocks comparable) above this
    # hangs: no new iteration in the training log, or every GPU idle, for this long
    hang_minutes: float = key(number(), 15.0)
    startup_minutes: float = key(number(), 30.0)  # allowance before the first iteration appears
    idle_minutes: float = key(number(), 10.0)
    idle_util_pct: float = key(number(0, strict=False), 1.0)
    # the training log: "auto" = <job dir>/train.log, else the job's StdOut from `scontrol show job`;
    # "{job_dir}", "{job_id}", "{node}" are substituted; null = hang detection from GPU idleness only
    train_log: Optional[str] = key(string(allow_none=True), "auto")
    py_spy: Optional[str] = key(string(allow_none=True), "py-spy")  # null = never dump stacks
    requeue_on_hang: bool = key(boolean, False)
    # how to requeue: by default the torchrun template's own USR1 trap (checkpoint, ledger, max requeues)
    requeue_command: list[str] = key(str_list, ["scancel", "--batch", "--signal=USR1", "{job_id}"])
    command_timeout_s: float = key(number(), 20.0)
