"""Prometheus text files from real runs (the runner over simulated nodes through the fake NVML, the monitor and
the watch daemon as real processes), validated by the real `promtool check metrics` and read back the way
node_exporter's textfile collector merges a directory: every series in exactly one file, one HELP/TYPE per name."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.siteconfig import parse_config
from gpuguard.context import RunContext
from gpuguard.util.log import HookLog
from gpuguard.metrics.families import node_families
from gpuguard.metrics.node import remove_monitor_file_of_job, write_run_metrics
from gpuguard.metrics.state import new_xid_events, update_state
from gpuguard.metrics.textfile import Family, write_families
from gpuguard.monitor.detect import Alert
from gpuguard.monitor.metrics import monitor_families
from simnode import run_sim
from gpuguard.slurm.client import NodeState
from gpuguard.watch.loop import WatchDaemon

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "examples" / "scenarios"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


# --------------------------------------------------------------------------- helpers


def promtool_check_metrics(path: Path) -> None:
    """The real promtool's linter (naming, units, counters end in _total, HELP present): exit 0, nothing said."""
    assert os.path.exists(PROMTOOL), "promtool missing: `make deps` installs Debian's prometheus package"
    with open(path, "rb") as f:
        p = subprocess.run([PROMTOOL, "check", "metrics"], stdin=f, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), f"{path.name}: {p.stdout}{p.stderr}"


def collect_dir(directory: Path) -> dict[tuple[str, frozenset], float]:
    """What node_exporter serves from a textfile directory; fails on a series in two files (node_exporter#753)
    or one name with two HELP/TYPE texts (node_exporter#1885)."""
    series: dict[tuple[str, frozenset], float] = {}
    where: dict[tuple[str, frozenset], str] = {}
    meta: dict[str, tuple[str, str]] = {}
    for f in sorted(directory.glob("*.prom")):
        for fam in text_string_to_metric_families(f.read_text()):
            assert meta.setdefault(fam.name, (fam.type, fam.documentation)) == (fam.type, fam.documentation), fam.name
            for s in fam.samples:
                key = (s.name, frozenset(s.labels.items()))
                assert key not in series, f"{s.name}{s.labels} in both {where[key]} and {f.name}"
                series[key], where[key] = s.value, f.name
    return series


def read_metrics(path: Path) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(metrics, name, **labels):
    matches = [v for lab, v in metrics.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, metrics.get(name))
    return matches[0]


def wait_for(cond: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class MemorySlurm:
    """The SlurmClient seam: a node that is up and takes a drain."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None

    def get_node(self, name: str) -> Optional[NodeState]:
        return NodeState(name=name, states=frozenset({"IDLE", "DRAIN"} if self.reason else {"IDLE"}),
                         reason=self.reason)

    def drain(self, name: str, reason: str) -> None:
        self.reason = reason

    def undrain(self, name: str) -> None:
        self.reason = None


def config_data(tmp_path: Path, textfile_dir: Optional[str], **metrics: Any) -> dict[str, Any]:
    from gpuguard.simulate.build import build_fake_nvml

    data: dict[str, Any] = {"store": {"path": str(tmp_path / "state" / "{node}.db")},
                            "simulation": {"workdir": str(tmp_path / "sim"), "fake_nvml": str(build_fake_nvml())},
                            "logging": {"syslog": False}}
    if textfile_dir:
        data["metrics"] = {"textfile_dir": textfile_dir, **metrics}
    return data


def make_cfg(tmp_path, textfile_dir: Optional[str], **metrics: Any):
    return parse_config(yaml.safe_dump(config_data(tmp_path, textfile_dir, **metrics)), source="test")


def run(cfg, kind: str, scenario: str, slurm: MemorySlurm, node: str = "node2", job: Optional[str] = None,
        gpus: Optional[tuple[int, ...]] = None):
    ctx = RunContext(kind=kind, node=node, job_id=job, gpu_indices=gpus if gpus is not None else
                     (tuple(range(8)) if kind in ("prolog", "epilog") else None))
    return run_sim(ctx, cfg, simulate=str(SCENARIOS / f"{scenario}.yaml"), slurm_client=slurm)


# --------------------------------------------------------------------------- the node file (hook runs)


def test_every_hook_run_writes_one_node_file_that_promtool_accepts(tmp_path):
    prom = tmp_path / "textfile" / "node2"
    prom.mkdir(parents=True)
    for legacy in ("prolog", "healthcheck", "xid"):  # what an older gpuguard left behind
        (prom / f"gpuguard_{legacy}.prom").write_text("# TYPE gpuguard_run_drained gauge\ngpuguard_run_drained 0\n")
    cfg = make_cfg(tmp_path, str(tmp_path / "textfile" / "{node}"))
    slurm = MemorySlurm()
    assert run(cfg, "prolog", "xid79", slurm, job="77").verdict.outcome == "drain" and slurm.reason
    # slurmd's HealthCheckProgram (hook=True) exits 0 whatever it finds: slurmd ignores the code and gpuguard
    # drains itself (issue 16: the metric said 1 after a health check that exited 0)
    hc = run_sim(RunContext(kind="healthcheck", node="node2"), cfg, simulate=str(SCENARIOS / "xid79.yaml"),
                 slurm_client=slurm, hook=True)
    assert hc.exit_code == 0 and slurm.reason  # the node stays drained
    run(cfg, "epilog", "healthy-p5", slurm, job="77")

    assert sorted(p.name for p in prom.iterdir()) == ["gpuguard_node.prom"]  # no temp files, legacy ones gone
    promtool_check_metrics(prom / "gpuguard_node.prom")
    collect_dir(prom)
    m = read_metrics(prom / "gpuguard_node.prom")
    # one series per kind, side by side in one file
    assert value(m, "gpuguard_run_verdict", kind="prolog", verdict="drain") == 1
    assert value(m, "gpuguard_run_verdict", kind="prolog", verdict="pass") == 0
    assert value(m, "gpuguard_run_exit_code", node="node2", kind="prolog") == 1
    assert value(m, "gpuguard_run_exit_code", node="node2", kind="healthcheck") == 0
    # the epilog found nothing but refused (exit 1): the node's condition stands (issue 27)
    assert value(m, "gpuguard_run_verdict", kind="epilog", verdict="refused") == 1
    assert {lab["kind"] for lab, _ in m["gpuguard_run_last_timestamp_seconds"]} == {"prolog", "healthcheck",
                                                                                    "epilog"}
    assert value(m, "gpuguard_check_severity", kind="prolog", check="gpu.xid") == 3
    assert value(m, "gpuguard_check_severity", kind="prolog", check="gpu.temperature") == 0
    assert 0 < value(m, "gpuguard_probe_duration_seconds", kind="prolog", probe="nvml") < 10
    # the drain state, from gpuguard's own record of its drain
    assert value(m, "gpuguard_node_drained", node="node2") == 1
    # the GPU NVML lost, by the Xid line's PCI address: this node was never seen before it fell off the bus
    assert m["gpuguard_node_drained"][0][0] == {"node": "node2", "check": "gpu.xid", "keyword": "XID79",
                                                "gpu": "0000:86:00"}
    assert abs(value(m, "gpuguard_node_drained_since_timestamp_seconds") - time.time()) < 60
    assert value(m, "gpuguard_drain_operations_total", op="drain", outcome="done") == 1
    # the health check found the drain in place: not an operation (issue 16: "already" grew every health check)
    assert not [lab for lab, _ in m["gpuguard_drain_operations_total"] if lab.get("outcome") == "already"]
    # the Xid once, although the prolog, health check and epilog all read that kernel log
    assert value(m, "gpuguard_xid_events_total", **{"class": "fatal"}) == 1
    assert value(m, "gpuguard_xid_events_total", **{"class": "app"}) == 0
    assert value(m, "gpuguard_xid_code_events_total", code=79, **{"class": "fatal"}) == 1
    assert value(m, "gpuguard_runs_total", kind="prolog", verdict="drain") == 1
    assert value(m, "gpuguard_runs_total", kind="healthcheck", verdict="drain") == 1
    from gpuguard import __version__

    assert value(m, "gpuguard_build_info", version=__version__) == 1
    assert value(m, "gpuguard_healthcheck_interval_seconds") == 300
    assert value(m, "gpuguard_history_store_ok") == 1
    # GPU identity labels on GPU series, no job id anywhere on the node's series
    uuids = {lab["uuid"] for lab, _ in m["gpuguard_gpu_info"]}
    assert len(uuids) == 8 and all(lab["pci_bus_id"].startswith("0000:") for lab, _ in m["gpuguard_gpu_info"])
    assert not any("job_id" in lab or "job" in lab for series in m.values() for lab, _ in series)


def test_a_prolog_that_refuses_its_job_says_refused_not_pass(tmp_path):
    """The second prolog on a node with a standing condition finds nothing new (the Xid is behind the kernel-log
    position) but refuses its job (exit 1): its verdict series says `refused`, never `pass` (issue 27)."""
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    assert run(cfg, "prolog", "xid79", slurm, job="77").verdict.outcome == "drain"
    second = run(cfg, "prolog", "healthy-p5", slurm, job="78")  # nothing cleared the condition
    assert second.exit_code == 1 and second.refused and second.verdict.outcome == "pass"
    m = read_metrics(tmp_path / "prom" / "gpuguard_node.prom")
    assert value(m, "gpuguard_run_verdict", kind="prolog", verdict="refused") == 1
    assert value(m, "gpuguard_run_verdict", kind="prolog", verdict="pass") == 0
    assert value(m, "gpuguard_run_exit_code", kind="prolog") == 1
    assert value(m, "gpuguard_runs_total", kind="prolog", verdict="refused") == 1
    assert value(m, "gpuguard_runs_total", kind="prolog", verdict="pass") == 0
    promtool_check_metrics(tmp_path / "prom" / "gpuguard_node.prom")


def test_counters_start_at_zero_so_increase_sees_the_first_drain(tmp_path):
    """A counter series that first appears at 1 hides that increase from increase()/rate(): every counter a rule
    reads is in the file, at 0, from the first healthy run on."""
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    run(cfg, "healthcheck", "healthy-p5", slurm)
    m = read_metrics(tmp_path / "prom" / "gpuguard_node.prom")
    assert value(m, "gpuguard_node_drained") == 0 and "check" not in m["gpuguard_node_drained"][0][0]
    for op, outcome in (("drain", "done"), ("drain", "failed"), ("undrain", "done")):
        assert value(m, "gpuguard_drain_operations_total", op=op, outcome=outcome) == 0
    assert {lab["class"] for lab, v in m["gpuguard_xid_events_total"] if v == 0} == {"fatal", "app", "warn", "info"}
    assert value(m, "gpuguard_runs_total", kind="prolog", verdict="drain") == 0
    assert value(m, "gpuguard_gpu_ecc_errors_total", gpu=0, type="uncorrected") == 0

    run(cfg, "prolog", "ecc-dbe", slurm, job="1")
    m = read_metrics(tmp_path / "prom" / "gpuguard_node.prom")
    assert value(m, "gpuguard_drain_operations_total", op="drain", outcome="done") == 1
    # the health check found the drain in place: not an operation (issue 16: "already" grew every health check)
    assert not [lab for lab, _ in m["gpuguard_drain_operations_total"] if lab.get("outcome") == "already"]
    assert value(m, "gpuguard_node_drained") == 1
    assert {lab["keyword"] for lab, _ in m["gpuguard_node_drained"]} == {"XID48"}  # the DBE's Xid 48 leads
    assert value(m, "gpuguard_xid_events_total", **{"class": "fatal"}) == 1
    assert value(m, "gpuguard_runs_total", kind="prolog", verdict="drain") == 1
    assert value(m, "gpuguard_runs_total", kind="healthcheck", verdict="pass") == 1


def test_hooks_finishing_together_leave_the_file_at_the_latest_count(tmp_path, monkeypatch):
    """A burst of prologs through the node agent finishes together: each counts its run in the store and rewrites
    the file. The file must follow the store's order, or an earlier count written last leaves the counter behind
    (CI: 12 prologs, runs_total 11). Here the writer with the lowest count is the slowest to write its file."""
    import gpuguard.metrics.node as node_metrics

    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    result = run(cfg, "prolog", "healthy-p5", MemorySlurm(), job="1")  # run 1
    real = node_metrics.write_families

    def slow_for_early_counts(directory, source, families):
        families = list(families)
        runs = sum(v for f in families if f.name == "gpuguard_runs_total" for _, v in f.samples)
        time.sleep(max(0.0, 8 - runs) * 0.03)
        return real(directory, source, families)

    monkeypatch.setattr(node_metrics, "write_families", slow_for_early_counts)
    threads = [threading.Thread(target=write_run_metrics, args=(cfg, result)) for _ in range(6)]  # runs 2-7
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    m = read_metrics(tmp_path / "prom" / "gpuguard_node.prom")
    assert value(m, "gpuguard_runs_total", kind="prolog", verdict="pass") == 7


def test_drains_by_other_writers_are_counted_once_and_undrain_clears_the_state(tmp_path):
    """The watch daemon, `gpuguard undrain` and the NCCL sweep write drain records in the store between hook
    runs: the next run counts each record once, from the store's own id (pruning old rows changes nothing)."""
    from gpuguard.store.sqlite import Store

    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    run(cfg, "healthcheck", "healthy-p5", slurm)
    with Store(str(tmp_path / "state" / "node2.db")) as st:  # the watch daemon drained for an Xid 79
        st.record_drain(node="node2", op="drain", outcome="done", check_id="gpu.xid", action="reboot", run_id=None,
                        reason="gpuguard: XID79 gpu.xid: GPU has fallen off the bus [watch reboot]")
    slurm.reason = "gpuguard: XID79 gpu.xid: GPU has fallen off the bus [watch reboot]"
    run(cfg, "healthcheck", "healthy-p5", slurm)
    m = read_metrics(tmp_path / "prom" / "gpuguard_node.prom")
    assert value(m, "gpuguard_drain_operations_total", op="drain", outcome="done") == 1
    # the health check found the drain in place: not an operation (issue 16: "already" grew every health check)
    assert not [lab for lab, _ in m["gpuguard_drain_operations_total"] if lab.get("outcome") == "already"]
    assert m["gpuguard_node_drained"] == [({"node": "node2", "check": "gpu.xid", "keyword": "XID79"}, 1.0)]
    with Store(str(tmp_path / "state" / "node2.db")) as st:  # an admin lifts it; old rows are pruned
        st.record_drain(node="node2", op="undrain", outcome="done", check_id="gpu.xid", action=None, run_id=None,
                        reason=None)
        st.conn.execute("DELETE FROM drains WHERE op='drain'")
    run(cfg, "healthcheck", "healthy-p5", slurm)
    m = read_metrics(tmp_path / "prom" / "gpuguard_node.prom")
    assert value(m, "gpuguard_drain_operations_total", op="drain", outcome="done") == 1  # monotonic
    assert value(m, "gpuguard_drain_operations_total", op="undrain", outcome="done") == 1
    assert m["gpuguard_node_drained"] == [({"node": "node2"}, 0.0)]


def test_ecc_counters_and_gpu_series_persist_across_runs_that_see_fewer_gpus(tmp_path):
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    run(cfg, "healthcheck", "ecc-dbe", slurm)
    path = tmp_path / "prom" / "gpuguard_node.prom"
    m = read_metrics(path)
    bad = [lab for lab, v in m["gpuguard_gpu_ecc_errors_total"] if lab["type"] == "uncorrected" and v == 2]
    assert len(bad) == 1 and bad[0]["uuid"].startswith("GPU-")
    # a prolog for a 1-GPU job: the other 7 GPUs keep their series and the counter its value
    run(cfg, "prolog", "ecc-dbe", slurm, job="9", gpus=(0,))
    m2 = read_metrics(path)
    assert len(m2["gpuguard_gpu_info"]) == 8
    assert [lab for lab, v in m2["gpuguard_gpu_ecc_errors_total"] if lab["type"] == "uncorrected" and v == 2] == bad
    promtool_check_metrics(path)


def test_a_gpu_the_health_check_no_longer_sees_loses_its_series(tmp_path):
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    run(cfg, "healthcheck", "healthy-p5", slurm)
    assert len(read_metrics(tmp_path / "prom" / "gpuguard_node.prom")["gpuguard_gpu_info"]) == 8
    run(cfg, "healthcheck", "missing-gpu", slurm)
    assert len(read_metrics(tmp_path / "prom" / "gpuguard_node.prom")["gpuguard_gpu_info"]) == 7


def test_without_the_store_the_run_is_still_written_and_counters_stay_out(tmp_path):
    """A full or read-only disk under the store must not hide the run, nor restart counters at 0 (which
    Prometheus would read as a counter reset, then a jump)."""
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    result = run_sim(RunContext(kind="healthcheck", node="n1"), cfg, simulate=str(SCENARIOS / "xid79.yaml"),
                     dry_run=True)
    blocker = tmp_path / "file"
    blocker.write_text("")
    data = config_data(tmp_path, str(tmp_path / "prom"))
    data["store"]["path"] = str(blocker / "sub" / "{node}.db")
    write_run_metrics(parse_config(yaml.safe_dump(data), source="test"), result)
    path = tmp_path / "prom" / "gpuguard_node.prom"
    m = read_metrics(path)
    assert value(m, "gpuguard_history_store_ok") == 0
    assert value(m, "gpuguard_run_verdict", kind="healthcheck", verdict="drain") == 1
    assert not [n for n in m if n.endswith("_total")] and "gpuguard_node_drained" not in m
    promtool_check_metrics(path)


def test_xid_events_are_counted_once_per_boot_whatever_run_reads_them():
    ev = lambda seq=None, mono=None: SimpleNamespace(seq=seq, monotonic_s=mono, code=79)  # noqa: E731
    fresh, mark = new_xid_events([ev(seq=5), ev(seq=7)], "boot-a", {}, "epilog")
    assert len(fresh) == 2 and mark == {"boot": "boot-a", "seq": 7, "mono": None}
    fresh, mark = new_xid_events([ev(seq=5), ev(seq=7), ev(seq=9)], "boot-a", mark, "healthcheck")
    assert [e.seq for e in fresh] == [9] and mark["seq"] == 9
    fresh, mark = new_xid_events([ev(seq=2)], "boot-b", mark, "healthcheck")  # a reboot: sequence starts over
    assert len(fresh) == 1 and mark == {"boot": "boot-b", "seq": 2, "mono": None}
    fresh, mark = new_xid_events([ev(mono=10.5), ev(mono=11.0)], "boot-b", mark, "prolog")  # journal / dmesg
    fresh, mark = new_xid_events([ev(mono=11.0), ev(mono=12.0)], "boot-b", mark, "epilog")
    assert [e.monotonic_s for e in fresh] == [12.0]
    # no position at all: only runs that move the node's cursor count it
    assert new_xid_events([ev()], "boot-b", mark, "epilog")[0] == []
    assert len(new_xid_events([ev()], "boot-b", mark, "healthcheck")[0]) == 1


def test_not_configured_writes_and_imports_nothing(tmp_path):
    code = (
        "import sys, yaml\n"
        "from gpuguard.siteconfig import parse_config\n"
        "from gpuguard.metrics.node import write_run_metrics\n"
        "from gpuguard.metrics.heartbeat import WatchHeartbeat\n"
        "from gpuguard.util.log import HookLog\n"
        "cfg = parse_config('')\n"
        "write_run_metrics(cfg, None)\n"
        "hb = WatchHeartbeat('n1')\n"
        "hb.beat(cfg, 0.0, HookLog(use_syslog=False, stderr=False))\n"
        "print('prometheus_client' in sys.modules, 'sqlite3' in sys.modules, hb.due_in(cfg, 0.0))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["False", "False", "None"], p.stderr


def test_never_raises_on_an_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = make_cfg(tmp_path, str(blocker / "sub"))
    result = run_sim(RunContext(kind="healthcheck", node="n1"), cfg, simulate=str(SCENARIOS / "healthy-p5.yaml"),
                     dry_run=True)
    write_run_metrics(cfg, result)  # logs, does not raise


def test_atomic_replace_never_shows_a_partial_file(tmp_path):
    fams = [Family("gpuguard_test_value", "gauge", "test")]
    for i in range(300):
        fams[0].add(i, gpu=i, node="n1")
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        path = tmp_path / "gpuguard_monitor.prom"
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            n = sum(1 for f in text_string_to_metric_families(text) for _ in f.samples)
            if n != 300:
                bad.append(f"{n} samples")

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(50):
        write_families(str(tmp_path), "monitor", fams)
    stop.set()
    t.join()
    assert bad == []
    assert sorted(os.listdir(tmp_path)) == ["gpuguard_monitor.prom"]


def test_label_values_are_escaped_and_empty_labels_left_out(tmp_path):
    fam = Family("gpuguard_check_severity", "gauge", 'help with "quotes"')
    fam.add(3, node='n"1\n', check="gpu\\xid", gpu="", uuid=None)
    write_families(str(tmp_path), "node", [fam])
    m = read_metrics(tmp_path / "gpuguard_node.prom")
    assert m["gpuguard_check_severity"][0][0] == {"node": 'n"1\n', "check": "gpu\\xid"}
    promtool_check_metrics(tmp_path / "gpuguard_node.prom")


@pytest.mark.parametrize("kind", ["gauge", "counter"])
def test_counter_and_gauge_names(tmp_path, kind):
    fam = Family("gpuguard_things_total" if kind == "counter" else "gpuguard_things", kind, "h")
    fam.add(5, node="n")
    write_families(str(tmp_path), "x", [fam])
    promtool_check_metrics(tmp_path / "gpuguard_x.prom")
    names = {s.name for f in text_string_to_metric_families((tmp_path / "gpuguard_x.prom").read_text())
             for s in f.samples}
    assert names == ({"gpuguard_things_total"} if kind == "counter" else {"gpuguard_things"})


def test_metric_names_use_base_units(tmp_path):
    """Prometheus naming: base units (seconds, bytes, hertz, celsius, watts, ratio), never percent/MiB/MHz/ms."""
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    result = run(cfg, "prolog", "xid79", MemorySlurm(), job="1")
    state = update_state({}, result, lambda ev: "fatal", [(1, "drain", "done")])
    names = {f.name for f in node_families(state, "n", None, "0", 300.0)}
    report = {"node": "n", "job_id": "1", "ts": 1.0, "interval_s": 10.0, "gpus": [{"index": 0}], "host": {}}
    names |= {f.name for f in monitor_families(report, [], {"rss_bytes": 1.0})}
    bad_units = ("_percent", "_pct", "_mib", "_mhz", "_milliseconds", "_ms", "_kb", "_mb", "_minutes")
    assert not [n for n in names if any(u in n for u in bad_units)]


# --------------------------------------------------------------------------- the monitor's file


BUSY = {"utilization_pct": 97, "throttle": ["sw_power_cap", "hw_slowdown"], "power_w": 650, "temperature_c": 62,
        "memory_used_mib": 1024}


def test_monitor_series_in_base_units_one_per_throttle_reason_and_no_job_id_on_gpus(tmp_path):
    alerts = [Alert("hang", "monitor.progress", "critical", "no progress", scope="job"),
              Alert("straggler", "monitor.gpu_clock", "warning", "slow", gpu=3)]
    report = {"node": "n1", "job_id": "5150", "ts": 1700000000.0, "interval_s": 10.0, "last_iteration": 120,
              "last_progress": 1699999990.0, "step_time_s": 1.25, "monitor_cpu_s": 0.5, "nvml_error": None,
              "host": {"cpu_pct": 50.0, "mem_pct": 40.0, "disk_used_pct": {"/": 10.0}},
              "gpus": [{"index": i, "uuid": f"GPU-{i}", "util_pct": 97, "mem_used_mib": 1024, "mem_total_mib": 81559,
                        "temp_c": 62, "temp_slowdown_c": 87, "power_w": 650.5, "sm_clock_mhz": 1980,
                        "sm_clock_max_mhz": 1980, "mem_clock_mhz": 2619, "throttle_mask": 0x4 | 0x8}
                       for i in range(2)]}
    write_families(str(tmp_path), "monitor", monitor_families(report, alerts, {"rss_bytes": 3e7}))
    path = tmp_path / "gpuguard_monitor.prom"
    promtool_check_metrics(path)
    m = read_metrics(path)
    assert value(m, "gpuguard_gpu_utilization_ratio", gpu=1) == pytest.approx(0.97)
    assert value(m, "gpuguard_gpu_memory_used_bytes", gpu=0) == 1024 * 2**20
    assert value(m, "gpuguard_gpu_sm_clock_hertz", gpu=0) == 1980e6
    assert value(m, "gpuguard_gpu_power_watts", gpu=0) == 650.5
    assert value(m, "gpuguard_gpu_temperature_celsius", gpu=0, uuid="GPU-0") == 62
    reasons = {lab["reason"]: v for lab, v in m["gpuguard_gpu_clock_event_active"] if lab["gpu"] == "0"}
    assert reasons["hw_slowdown"] == 1 and reasons["sw_power_cap"] == 1 and reasons["hw_thermal"] == 0
    assert len(reasons) == 9  # every nvmlClocksEventReason, each its own 0/1 series
    assert not any("job_id" in lab for n, series in m.items() if n.startswith("gpuguard_gpu_") for lab, _ in series)
    assert value(m, "gpuguard_monitor_alert", kind="hang", job_id=5150) == 1
    assert value(m, "gpuguard_monitor_alert", kind="straggler", gpu=3, check="monitor.gpu_clock") == 1
    assert value(m, "gpuguard_train_last_progress_timestamp_seconds", job_id=5150) == 1699999990.0
    assert value(m, "gpuguard_monitor_cpu_seconds_total", job_id=5150) == 0.5
    assert not [n for n in m if n.startswith("gpuguard_node_")]  # node_exporter's job: CPU, memory, disk, network


def _monitor_cmd(cfg_path: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpuguard", "monitor", "--config", str(cfg_path), "--job-dir",
            str(tmp_path / "job"), "--node", "node1", "--job-id", "5150", "--interval", "0.2", *extra]


def _monitor_site(tmp_path: Path) -> Path:
    scenario = tmp_path / "busy.yaml"
    scenario.write_text(yaml.safe_dump({"instance_type": "p5.48xlarge", "gpus": {"defaults": BUSY}}))
    data = config_data(tmp_path, str(tmp_path / "prom" / "{node}"))
    data["simulation"]["scenario"] = str(scenario)
    data["monitor"] = {"train_log": None}
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    return cfg_path


def test_monitor_removes_its_file_on_sigterm_and_at_the_end_of_its_duration(tmp_path):
    cfg_path = _monitor_site(tmp_path)
    path = tmp_path / "prom" / "node1" / "gpuguard_monitor.prom"
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    proc = subprocess.Popen(_monitor_cmd(cfg_path, tmp_path), env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(path.exists, 30, "the monitor's metrics file")
        promtool_check_metrics(path)
        m = read_metrics(path)
        assert value(m, "gpuguard_gpu_clock_event_active", gpu=7, reason="hw_slowdown") == 1
        assert value(m, "gpuguard_gpu_utilization_ratio", gpu=7) == pytest.approx(0.97)
        proc.send_signal(signal.SIGTERM)  # what srun/scancel do to the sidecar at the end of the job
        assert proc.wait(15) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not path.exists()
    p = subprocess.run(_monitor_cmd(cfg_path, tmp_path, "--duration", "0.5"), env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "stopping after" in p.stderr and not path.exists(), p.stderr


def test_epilog_removes_the_file_of_a_killed_monitor_of_its_job_only(tmp_path):
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    report = {"node": "node2", "job_id": "42", "ts": 1.0, "gpus": [], "host": {}}
    write_families(str(tmp_path / "prom"), "monitor", monitor_families(report, [], {"rss_bytes": 1.0}))
    path = tmp_path / "prom" / "gpuguard_monitor.prom"
    run(cfg, "epilog", "healthy-p5", MemorySlurm(), job="41")
    assert path.exists()  # another job's sidecar (a shared node): not ours to remove
    run(cfg, "epilog", "healthy-p5", MemorySlurm(), job="42")
    assert not path.exists()
    assert remove_monitor_file_of_job(str(tmp_path / "prom"), "42") is False


# --------------------------------------------------------------------------- the watch daemon's heartbeat


def _watch_config(tmp_path: Path, textfile_dir: str, heartbeat_s: float) -> str:
    log = tmp_path / "kern.log"
    log.touch()
    return yaml.safe_dump({"store": {"path": str(tmp_path / "state" / "{node}.db")},
                           "slurm": {"scontrol": str(tmp_path / "no-scontrol"), "backend": "cli"},
                           "logging": {"syslog": False, "file": str(tmp_path / "gpuguard.log")},
                           "watch": {"source": f"file:{log}"},
                           "metrics": {"textfile_dir": textfile_dir, "watch_heartbeat_s": heartbeat_s}})


def test_watch_heartbeat_advances_and_a_clean_stop_says_so(tmp_path):
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(_watch_config(tmp_path, str(tmp_path / "prom" / "{node}"), 0.2))
    path = tmp_path / "prom" / "n1" / "gpuguard_watch.prom"
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard.watch.daemon", "--config", str(cfg_path), "--node", "n1"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(path.exists, 30, "the heartbeat file")
        first = value(read_metrics(path), "gpuguard_watch_last_heartbeat_timestamp_seconds", node="n1")
        later = wait_for(lambda: value(read_metrics(path), "gpuguard_watch_last_heartbeat_timestamp_seconds") > first
                         and read_metrics(path), 10, "a later heartbeat")
        assert value(later, "gpuguard_watch_up") == 1
        assert value(later, "gpuguard_watch_heartbeat_interval_seconds") == 0.2
        assert value(later, "gpuguard_watch_pending_drains") == 0
        assert abs(value(later, "gpuguard_watch_last_heartbeat_timestamp_seconds") - time.time()) < 10
        promtool_check_metrics(path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stopped = read_metrics(path)
    assert value(stopped, "gpuguard_watch_up") == 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["gpuguard_watch.prom"]


def test_watch_heartbeat_write_failure_is_logged_once_and_the_watch_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = parse_config(_watch_config(tmp_path, str(blocker / "prom"), 0.05), "test.yaml")
    log_path = tmp_path / "gpuguard.log"
    daemon = WatchDaemon(cfg, node="n1", log=HookLog(use_syslog=False, path=str(log_path), stderr=False))
    t = threading.Thread(target=daemon.run, daemon=True)
    t.start()
    assert daemon.ready.wait(10)
    time.sleep(0.5)  # ~10 beats
    assert t.is_alive()
    daemon.request_stop()
    t.join(10)
    assert log_path.read_text().count("cannot write the heartbeat metric") == 1


def test_watch_once_writes_no_heartbeat(tmp_path):
    cfg = parse_config(_watch_config(tmp_path, str(tmp_path / "prom"), 0.05), "test.yaml")
    daemon = WatchDaemon(cfg, node="n1", once=True, log=HookLog(use_syslog=False, stderr=False))
    assert daemon.run() == 0
    assert not (tmp_path / "prom").exists()


# --------------------------------------------------------------------------- everything together


def test_one_directory_with_every_writer_has_no_duplicate_series(tmp_path):
    """The node file, the watch heartbeat and the monitor in one textfile directory, as on a node."""
    d = tmp_path / "prom"
    cfg = make_cfg(tmp_path, str(d))
    slurm = MemorySlurm()
    run(cfg, "healthcheck", "ecc-dbe", slurm)
    run(cfg, "prolog", "xid79", slurm, job="5150")
    from gpuguard.metrics.heartbeat import watch_families

    write_families(str(d), "watch", watch_families("node2", time.time(), time.time(), 30.0, True, 0))
    report = {"node": "node2", "job_id": "5150", "ts": time.time(), "interval_s": 10.0, "host": {},
              "gpus": [{"index": i, "uuid": f"GPU-{i}", "util_pct": 50, "throttle_mask": 0} for i in range(8)]}
    write_families(str(d), "monitor", monitor_families(report, [], {"rss_bytes": 1.0}))
    series = collect_dir(d)
    assert len(series) > 100
    for f in d.glob("*.prom"):
        promtool_check_metrics(f)


class _HungController(MemorySlurm):
    """slurmctld down: every call fails, as the CLI client's do when scontrol times out."""

    def get_node(self, name):
        from gpuguard.slurm.client import SlurmTimeout

        raise SlurmTimeout("scontrol show node timed out after 5 s")

    drain = set_reason = undrain = get_node  # type: ignore[assignment]


def test_a_pending_drain_is_in_the_metrics_and_in_gpuguard_status_with_its_age(tmp_path):
    """Issue 14: a drain Slurm could not take shows as pending, with its age, in the node's metrics and in
    `gpuguard status` (the lines an admin sees first), until it is applied."""
    from gpuguard.cli.status import own_health
    from gpuguard.cli.status_render import render_own_health
    from gpuguard.pipeline.journal import runtime_dir

    prom = tmp_path / "textfile" / "node2"
    cfg = make_cfg(tmp_path, str(tmp_path / "textfile" / "{node}"))
    r = run(cfg, "healthcheck", "xid79", _HungController())
    assert r.verdict.outcome == "drain" and r.drain["outcome"] == "failed"
    m = read_metrics(prom / "gpuguard_node.prom")
    assert value(m, "gpuguard_pending_drains", node="node2") == 1
    decided = value(m, "gpuguard_pending_drain_oldest_timestamp_seconds", node="node2")
    assert abs(decided - time.time()) < 60
    health = own_health(runtime_dir(cfg))
    (line,) = [x for x in render_own_health(cfg, health, decided + 600) if x.startswith("PENDING")]
    assert "drain on node2 for 10m" in line and "XID79" in line and "jobs refused until Slurm takes it" in line

    slurm = MemorySlurm()  # slurmctld is back: the next run applies it and nothing is pending any more
    run(cfg, "healthcheck", "xid79", slurm)
    assert slurm.reason and "XID79" in slurm.reason
    assert value(read_metrics(prom / "gpuguard_node.prom"), "gpuguard_pending_drains", node="node2") == 0
    assert not own_health(runtime_dir(cfg))["pending"]
    # the fault itself still stands as a condition of the node, until a reboot (XID79): status says so
    lines = [x for x in render_own_health(cfg, own_health(runtime_dir(cfg)), time.time())
             if x.startswith("CONDITION")]
    (line,) = [x for x in lines if "XID79" in x]  # gpu.count's GPUCOUNT too: GPU 3 is gone
    assert line.startswith("CONDITION on node2 since ") and "XID79 gpu.xid (reboot)" in line, lines
    assert "jobs refused until a reboot" in line


def test_status_lists_the_conditions_of_a_node_whose_journal_a_reboot_removed(tmp_path):
    from gpuguard.cli.status import own_health
    from gpuguard.pipeline.journal import conditions_copy_path, journal_for, runtime_dir

    cfg = make_cfg(tmp_path, None)
    r = run(cfg, "healthcheck", "xid79", MemorySlurm())
    assert r.verdict.outcome == "drain"
    j = journal_for(cfg, "node2")
    assert "XID79" in [c.keyword for c in j.conditions]
    os.unlink(j.path)  # a reboot emptied /run (the boot id did not change here: the condition stands)
    copies = os.path.dirname(conditions_copy_path(cfg, "node2"))
    assert "XID79" in [c["keyword"] for c in own_health(runtime_dir(cfg), copies)["conditions"]]
    assert own_health(runtime_dir(cfg))["conditions"] == []


# --------------------------------------------------------------------------- how hooks ran: the node agent (issue 30)


@pytest.mark.parametrize("via, label", [
    ("agent", "agent"),
    (None, "no_agent"),
    ("local(agent refused code changed)", "refused"),
    ("local(agent did not start a child within 0.5s (idle))", "agent_idle"),
    ("local(agent child did not take the hook within 0.51s (idle))", "agent_idle"),
    ("local(agent did not start a child within 5s (busy))", "agent_busy"),
    ("local(agent child ended before taking the hook)", "child_lost"),
    ("local(agent child gave no verdict)", "child_lost"),
    ("local(agent unreachable: PermissionError)", "unreachable"),
    ("local(agent of another user)", "other_user"),
    ("local(no socket: Too many open files)", "other"),
])
def test_the_result_lines_via_becomes_a_bounded_label(via: Optional[str], label: str):
    from gpuguard.metrics.state import VIA, via_label

    assert via_label(via) == label and label in VIA


def test_hook_runs_are_counted_by_how_they_ran(tmp_path):
    """How many hooks the agent ran, how many fell back to their own process and why: a node whose agent is
    stopped, outdated or overloaded shows it in a counter, not only in grep -c 'via=local(' of its log."""
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    for i, via in enumerate(("agent", "agent", None, "local(agent did not start a child within 5s (busy))",
                             "local(agent refused code changed)")):
        ctx = RunContext(kind="prolog", node="node2", job_id=str(i), gpu_indices=tuple(range(8)), via=via)
        assert run_sim(ctx, cfg, simulate=str(SCENARIOS / "healthy-p5.yaml"), slurm_client=slurm).exit_code == 0
    m = read_metrics(tmp_path / "prom" / "gpuguard_node.prom")
    assert value(m, "gpuguard_hook_runs_via_total", kind="prolog", via="agent") == 2
    assert value(m, "gpuguard_hook_runs_via_total", kind="prolog", via="no_agent") == 1
    assert value(m, "gpuguard_hook_runs_via_total", kind="prolog", via="agent_busy") == 1
    assert value(m, "gpuguard_hook_runs_via_total", kind="prolog", via="refused") == 1
    # every series a rule reads is there from the first run, at 0
    assert value(m, "gpuguard_hook_runs_via_total", kind="prolog", via="agent_idle") == 0
    assert value(m, "gpuguard_hook_runs_via_total", kind="healthcheck", via="child_lost") == 0
    promtool_check_metrics(tmp_path / "prom" / "gpuguard_node.prom")
