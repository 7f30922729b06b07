"""The monitor's Prometheus families (written to `gpuguard_monitor.prom` by gpuguard.metrics). Pure."""

from __future__ import annotations

from typing import Any

from gpuguard.metrics import Family
from gpuguard.monitor.detect import Alert

_GPU = (("util_pct", "gpuguard_gpu_utilization_percent", "GPU utilisation"),
        ("mem_used_mib", "gpuguard_gpu_memory_used_mib", "GPU memory used (MiB)"),
        ("mem_total_mib", "gpuguard_gpu_memory_total_mib", "GPU memory (MiB)"),
        ("temp_c", "gpuguard_gpu_temperature_celsius", "GPU temperature"),
        ("power_w", "gpuguard_gpu_power_watts", "GPU power draw"),
        ("sm_clock_mhz", "gpuguard_gpu_sm_clock_mhz", "SM clock"),
        ("sm_clock_max_mhz", "gpuguard_gpu_sm_clock_max_mhz", "Maximum SM clock"),
        ("mem_clock_mhz", "gpuguard_gpu_memory_clock_mhz", "Memory clock"),
        ("throttle_mask", "gpuguard_gpu_clock_event_reasons", "nvmlClocksEventReason bitmask (0x8 HW slowdown, "
                                                             "0x40 HW thermal, 0x80 power brake)"),
        ("ecc_uncorrected", "gpuguard_gpu_ecc_volatile_uncorrected", "Volatile uncorrectable ECC errors"),
        ("ecc_corrected", "gpuguard_gpu_ecc_volatile_corrected", "Volatile correctable ECC errors"))
_HOST = (("cpu_pct", "gpuguard_node_cpu_percent", "Node CPU busy"),
         ("mem_pct", "gpuguard_node_memory_used_percent", "Node memory used"),
         ("disk_read_bps", "gpuguard_node_disk_read_bytes_per_second", "Disk read rate"),
         ("disk_write_bps", "gpuguard_node_disk_write_bytes_per_second", "Disk write rate"),
         ("net_rx_bps", "gpuguard_node_network_receive_bytes_per_second", "Network receive rate"),
         ("net_tx_bps", "gpuguard_node_network_transmit_bytes_per_second", "Network transmit rate"))


def monitor_families(report: dict[str, Any], alerts: list[Alert], cost: dict[str, float]) -> list[Family]:
    node, job = report["node"], report.get("job_id") or ""
    fams = []
    for key, name, help_text in _GPU:
        fam = Family(name, "gauge", help_text)
        for g in report["gpus"]:
            fam.add(g.get(key), node=node, job_id=job, gpu=g["index"])
        fams.append(fam)
    host = report["host"]
    for key, name, help_text in _HOST:
        fam = Family(name, "gauge", help_text)
        fam.add(host.get(key), node=node, job_id=job)
        fams.append(fam)
    disk = Family("gpuguard_node_disk_used_percent", "gauge", "Filesystem space used")
    for path, pct in sorted(host.get("disk_used_pct", {}).items()):
        disk.add(pct, node=node, job_id=job, path=path)
    fams.append(disk)
    it = Family("gpuguard_train_last_iteration", "gauge", "Last training iteration seen in the training log")
    it.add(report.get("last_iteration"), node=node, job_id=job)
    since = Family("gpuguard_train_seconds_since_progress", "gauge", "Seconds since the last new iteration")
    if report.get("last_progress"):
        since.add(report["ts"] - report["last_progress"], node=node, job_id=job)
    step = Family("gpuguard_train_step_seconds", "gauge", "Median iteration time from the training log")
    step.add(report.get("step_time_s"), node=node, job_id=job)
    active = Family("gpuguard_monitor_alert", "gauge", "1 for each condition the monitor currently reports")
    for a in alerts:
        active.add(1.0, node=node, job_id=job, kind=a.kind, check=a.check_id,
                   gpu="" if a.gpu is None else a.gpu)
    last = Family("gpuguard_monitor_last_sample_timestamp_seconds", "gauge", "When the monitor last sampled")
    last.add(report["ts"], node=node, job_id=job)
    cpu = Family("gpuguard_monitor_cpu_percent", "gauge", "The monitor's own CPU use, % of one core, since start")
    cpu.add(cost["cpu_pct_of_one_core"], node=node, job_id=job)
    rss = Family("gpuguard_monitor_rss_bytes", "gauge", "The monitor's resident memory")
    rss.add(cost["rss_bytes"], node=node, job_id=job)
    return fams + [it, since, step, active, last, cpu, rss]
