"""A health check's drain for Xid 79 names the GPU (issue 29, item 8): the Xid line gives the PCI address
(`0000:86:00`), NVML writes `00000000:86:00.0`, and a GPU that fell off the bus is missing from NVML. The index comes
from NVML, else from the addresses the node's GPUs had in earlier runs (the inventory in the store), else the PCI
address itself is the label. Whole runs of the pipeline on the simulated node; the alert in a REAL Alertmanager;
the node file node_exporter reads."""

from __future__ import annotations

import time

import pytest
import yaml
from alertmanager_server import AMTOOL, BINARY, Alertmanager, routed_config
from prometheus_client.parser import text_string_to_metric_families
from simnode import SCENARIOS, MemorySlurm, run_sim

from gpuguard.siteconfig import parse_config
from gpuguard.context import RunContext

needs_am = pytest.mark.skipif(not BINARY or not AMTOOL, reason="prometheus-alertmanager / amtool missing: make deps")


@pytest.fixture
def am(tmp_path, hook):
    a = Alertmanager(tmp_path / "am", routed_config(f"http://127.0.0.1:{hook.port}", group_wait="5s"))
    yield a
    a.stop()


def _cfg(tmp_path, am_url):
    from gpuguard.simulate.build import build_fake_nvml

    data = {"store": {"path": str(tmp_path / "state" / "{node}.db"), "runtime_dir": str(tmp_path / "run")},
            "simulation": {"workdir": str(tmp_path / "sim"), "fake_nvml": str(build_fake_nvml())},
            "logging": {"syslog": False}, "metrics": {"textfile_dir": str(tmp_path / "prom")},
            "notify": {"alertmanager_urls": [am_url], "cluster": "c1", "timeout_s": 2}}
    return parse_config(yaml.safe_dump(data), source="test")


def _healthcheck(cfg, scenario, slurm):
    return run_sim(RunContext(kind="healthcheck", node="node2"), cfg, simulate=str(SCENARIOS / f"{scenario}.yaml"),
                   slurm_client=slurm)


def _alert(am, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = [a for a in am.alerts() if a["labels"].get("alertname") == "GpuguardDrain"]
        if got:
            return got[0]["labels"]
        time.sleep(0.1)
    raise AssertionError(f"no drain alert: {am.alerts()}")


def _drained_series(tmp_path):
    text = (tmp_path / "prom" / "gpuguard_node.prom").read_text()
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "gpuguard_node_drained" and s.value == 1]


@needs_am
def test_the_xid79_drain_names_the_gpu_nvml_no_longer_sees_from_the_nodes_inventory(tmp_path, am):
    cfg = _cfg(tmp_path, am.url)
    slurm = MemorySlurm()
    assert _healthcheck(cfg, "healthy-p5", slurm).verdict.outcome == "pass"  # GPU 3 seen at 0000:86:00
    result = _healthcheck(cfg, "xid79", slurm)  # GPU 3 fell off the bus: NVML lists 7 GPUs
    assert result.verdict.outcome == "drain" and slurm.reason
    assert "GPU 3 0000:86:00" in result.verdict.primary.message
    labels = _alert(am)
    assert labels["node"] == "node2" and labels["keyword"] == "XID79"
    assert labels["gpu"] == "3" and labels["gpu_pci"] == "0000:86:00", labels
    assert [lab.get("gpu") for lab in _drained_series(tmp_path)] == ["3"]


@needs_am
def test_without_an_inventory_the_pci_address_is_the_gpu_label(tmp_path, am):
    cfg = _cfg(tmp_path, am.url)
    slurm = MemorySlurm()
    assert _healthcheck(cfg, "xid79", slurm).verdict.outcome == "drain"  # first run ever: no index known
    labels = _alert(am)
    assert labels["gpu"] == "0000:86:00" and labels["gpu_pci"] == "0000:86:00", labels
    assert [lab.get("gpu") for lab in _drained_series(tmp_path)] == ["0000:86:00"]
