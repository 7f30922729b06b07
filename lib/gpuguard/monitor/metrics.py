"""The monitor's Prometheus families (written to `gpuguard_monitor.prom` by gpuguard.metrics.textfile, removed when the
monitor exits). Pure.

Two kinds of series:
- node series, per GPU (`node`, `gpu` index, `uuid`, `pci_bus_id` when the sample has it): live telemetry in base
  units (ratio 0-1, bytes, celsius, watts, hertz) and one 0/1 series per clock-event (throttle) reason. No job id:
  a label that changes with every job would make a new series per job on every GPU.
- job series (`node`, `job_id`): training progress, the monitor's alerts (stragglers, hangs, thresholds) and its
  own liveness and cost; one set per job, gone when the monitor exits.

The node's CPU, memory, disk and network are node_exporter's (node_cpu_seconds_total, node_memory_*,
node_filesystem_*, node_disk_*, node_network_*): the monitor judges them but does not export them again.
ECC counters are in gpuguard_node.prom (lifetime counts, from every hook run).
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.metrics.textfile import Family
from gpuguard.monitor.detect import Alert
from gpuguard.monitor.sampler import ALL_THROTTLE_NAMES

_MIB = float(2**20)
_MHZ = 1e6
# sample key, metric name, help, factor to the base unit
_GPU = (("util_pct", "gpuguard_gpu_utilization_ratio", "GPU utilisation (0-1) over NVML's last sample period", 0.01),
        ("mem_used_mib", "gpuguard_gpu_memory_used_bytes", "GPU memory in use", _MIB),
        ("mem_total_mib", "gpuguard_gpu_memory_total_bytes", "GPU memory", _MIB),
        ("temp_c", "gpuguard_gpu_temperature_celsius", "GPU temperature", 1.0),
        ("temp_slowdown_c", "gpuguard_gpu_slowdown_temperature_celsius",
         "Temperature at which the GPU slows itself down (NVML threshold)", 1.0),
        ("power_w", "gpuguard_gpu_power_watts", "GPU power draw", 1.0),
        ("sm_clock_mhz", "gpuguard_gpu_sm_clock_hertz", "SM clock", _MHZ),
        ("sm_clock_max_mhz", "gpuguard_gpu_sm_clock_max_hertz", "Maximum SM clock", _MHZ),
        ("mem_clock_mhz", "gpuguard_gpu_memory_clock_hertz", "Memory clock", _MHZ))


def _scaled(value: Optional[float], factor: float) -> Optional[float]:
    return None if value is None else float(value) * factor


def gpu_labels(node: str, g: dict[str, Any]) -> dict[str, Any]:
    return {"node": node, "gpu": g["index"], "uuid": g.get("uuid"), "pci_bus_id": g.get("pci_bus_id")}


def monitor_families(report: dict[str, Any], alerts: list[Alert], cost: dict[str, float]) -> list[Family]:
    node, job = report["node"], report.get("job_id") or ""
    fams = []
    for key, name, help_text, factor in _GPU:
        fam = Family(name, "gauge", help_text)
        for g in report["gpus"]:
            fam.add(_scaled(g.get(key), factor), **gpu_labels(node, g))
        fams.append(fam)
    events = Family("gpuguard_gpu_clock_event_active", "gauge",
                    "1 while NVML reports this clock-event (throttle) reason, 0 when not; hw_slowdown, hw_thermal "
                    "and hw_power_brake slow the GPU against the job's will")
    for g in report["gpus"]:
        mask = g.get("throttle_mask")
        if mask is None:
            continue
        for bit, reason in sorted(ALL_THROTTLE_NAMES.items()):
            events.add(1 if int(mask) & bit else 0, **gpu_labels(node, g), reason=reason)
    fams.append(events)

    def job_family(name: str, kind: str, help_text: str, value: Optional[float]) -> Family:
        fam = Family(name, kind, help_text)
        fam.add(value, node=node, job_id=job)
        return fam

    fams += [
        job_family("gpuguard_monitor_last_sample_timestamp_seconds", "gauge", "When the monitor last sampled",
                   report["ts"]),
        job_family("gpuguard_monitor_interval_seconds", "gauge", "The monitor's sampling interval",
                   report.get("interval_s")),
        job_family("gpuguard_monitor_gpu_sampling_ok", "gauge",
                   "1 when the monitor reads the GPUs through NVML, 0 when NVML could not start (node sampling and "
                   "hang detection go on)", 0 if report.get("nvml_error") else 1),
        job_family("gpuguard_train_last_iteration", "gauge", "Last training iteration seen in the training log",
                   report.get("last_iteration")),
        job_family("gpuguard_train_last_progress_timestamp_seconds", "gauge",
                   "When the training log last showed a new iteration", report.get("last_progress")),
        job_family("gpuguard_train_iteration_seconds", "gauge", "Median iteration time from the training log",
                   report.get("step_time_s")),
        job_family("gpuguard_monitor_cpu_seconds_total", "counter", "CPU time the monitor itself used",
                   report.get("monitor_cpu_s")),
        job_family("gpuguard_monitor_resident_memory_bytes", "gauge", "The monitor's resident memory",
                   cost.get("rss_bytes")),
    ]
    active = Family("gpuguard_monitor_alert", "gauge",
                    "1 for each condition the monitor reports now (kind straggler, hang or resource; check; GPU)")
    for a in alerts:
        active.add(1, node=node, job_id=job, kind=a.kind, check=a.check_id, severity=a.severity,
                   gpu=None if a.gpu is None else a.gpu)
    fams.append(active)
    return fams
