"""EFA hardware counters: read from a sysfs tree laid out like the kernel's (efa driver hw_counters), deltas
between runs kept as a store cursor, resets and reboots, and the fabric.efa_counters check."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.checks import CheckInput, get_check
from gpuguard.model import Observations, Severity
from gpuguard.probes.efa_counters import (counter_deltas, cursor_name, parse_counter_value, read_counter_tree,
                                          read_efa_counters)
from gpuguard.profiles import load_profile
from gpuguard.simulate.sysfs import write_fake_infiniband
from gpuguard.store.sqlite import Store

check_efa_counters = get_check("fabric.efa_counters")  # the check, with its spec bound

# the counter files the efa driver creates per port (kernel efa_com_cmd.h stats; prometheus/procfs)
EFA_FILES = ["alloc_pd_err", "alloc_ucontext_err", "cmds_err", "completed_cmds", "create_ah_err", "create_cq_err",
             "create_qp_err", "impaired_remote_conn_events", "keep_alive_rcvd", "lifespan", "mmap_err",
             "no_completion_cmds", "rdma_read_bytes", "rdma_read_resp_bytes", "rdma_read_wr_err", "rdma_read_wrs",
             "rdma_write_bytes", "rdma_write_recv_bytes", "rdma_write_wr_err", "rdma_write_wrs", "recv_bytes",
             "recv_wrs", "reg_mr_err", "retrans_bytes", "retrans_pkts", "retrans_timeout_events", "rx_bytes",
             "rx_drops", "rx_pkts", "send_bytes", "send_wrs", "submitted_cmds", "tx_bytes", "tx_pkts",
             "unresponsive_remote_events"]


def make_tree(root: Path, n_efa: int = 2) -> Path:
    devices = [{"name": f"rdmap{16 + i}s27", "kind": "efa"} for i in range(n_efa)]
    devices.append({"name": "mlx5_0", "kind": "ib"})  # not EFA: ignored
    write_fake_infiniband(root, devices)
    for i in range(n_efa):
        set_counters(root, f"rdmap{16 + i}s27", {name: 0 for name in EFA_FILES} | {"lifespan": 12})
    hw = root / "class/infiniband/mlx5_0/ports/1/hw_counters"
    hw.mkdir(parents=True)
    (hw / "rx_write_requests").write_text("5\n")
    return root


def set_counters(root: Path, dev: str, values: dict[str, int | str]) -> None:
    hw = root / "class" / "infiniband" / dev / "ports" / "1" / "hw_counters"
    hw.mkdir(parents=True, exist_ok=True)
    for name, v in values.items():
        (hw / name).write_text(f"{v}\n")


def inp(**params) -> CheckInput:
    return CheckInput(profile=load_profile("p5.48xlarge"), params=params, kind="healthcheck")


def test_reads_only_efa_ports_and_skips_lifespan(tmp_path):
    root = make_tree(tmp_path)
    ports, unreadable = read_counter_tree(str(root))
    assert [p.key for p in ports] == ["rdmap16s27/1", "rdmap17s27/1"]
    assert "lifespan" not in ports[0].values and len(ports[0].values) == len(EFA_FILES) - 1
    assert unreadable == []


def test_first_reading_is_a_baseline_then_deltas(tmp_path):
    root = make_tree(tmp_path)
    first = read_efa_counters(str(root), None, boot_id="b1", now=1000.0)
    assert first.deltas is None and "first reading" in first.baseline_reason
    assert check_efa_counters(Observations(efa_counters=first), inp(max_rx_drops=0))[0].severity is Severity.OK
    set_counters(root, "rdmap17s27", {"rx_drops": 40, "retrans_timeout_events": 3, "tx_bytes": 10**9})
    second = read_efa_counters(str(root), first.cursor, boot_id="b1", now=1300.0)
    assert second.interval_s == 300.0
    assert second.deltas["rdmap17s27/1"]["rx_drops"] == 40 and second.deltas["rdmap16s27/1"]["rx_drops"] == 0
    f = check_efa_counters(Observations(efa_counters=second), inp(max_rx_drops=10, max_retrans_timeout_events=0))
    assert [x.severity for x in f] == [Severity.FAIL] and f[0].keyword == "EFA"
    assert "rdmap17s27/1 rx_drops +40 (limit 10)" in f[0].message and "in 300s" in f[0].message
    assert "retrans_timeout_events +3" in " ".join(f[0].evidence["over"])


def test_growth_within_limits_and_unset_limits_are_not_judged(tmp_path):
    root = make_tree(tmp_path)
    first = read_efa_counters(str(root), None, boot_id="b1", now=0.0)
    set_counters(root, "rdmap16s27", {"retrans_pkts": 500})
    second = read_efa_counters(str(root), first.cursor, boot_id="b1", now=60.0)
    assert check_efa_counters(Observations(efa_counters=second), inp(max_retrans_pkts=1000))[0].severity is Severity.OK
    skipped = check_efa_counters(Observations(efa_counters=second), inp())[0]
    assert skipped.severity is Severity.SKIP and skipped.evidence["growth"] == {"rdmap16s27/1": {"retrans_pkts": 500}}


def test_counter_going_backwards_is_a_reset_and_reboot_starts_over(tmp_path):
    root = make_tree(tmp_path)
    set_counters(root, "rdmap16s27", {"rx_drops": 100})
    first = read_efa_counters(str(root), None, boot_id="b1", now=0.0)
    set_counters(root, "rdmap16s27", {"rx_drops": 7})  # driver reloaded
    second = read_efa_counters(str(root), first.cursor, boot_id="b1", now=10.0)
    assert second.reset == ["rdmap16s27/1"] and second.deltas["rdmap16s27/1"]["rx_drops"] == 7
    rebooted = read_efa_counters(str(root), second.cursor, boot_id="b2", now=20.0)
    assert rebooted.deltas is None and "rebooted" in rebooted.baseline_reason


def test_cursor_round_trips_through_the_store(tmp_path):
    root = make_tree(tmp_path)
    first = read_efa_counters(str(root), None, boot_id="b1", now=5.0)
    with Store(str(tmp_path / "s.db")) as st:
        st.set_cursor(cursor_name("node1"), first.cursor)
        prev = st.get_cursor("efa_counters:node1")
    set_counters(root, "rdmap16s27", {"unresponsive_remote_events": 2})
    again = read_efa_counters(str(root), prev, boot_id="b1", now=65.0)
    assert again.deltas["rdmap16s27/1"]["unresponsive_remote_events"] == 2


def test_unreadable_values_are_listed_not_fatal(tmp_path):
    root = make_tree(tmp_path)
    set_counters(root, "rdmap16s27", {"rx_drops": "N/A (no PMA)"})
    obs = read_efa_counters(str(root), None)
    assert obs.unreadable == ["rdmap16s27/1/rx_drops"] and "rx_drops" not in obs.ports[0].values


@pytest.mark.parametrize("text,value", [("42\n", 42), ("0x10", 16), ("", None), ("N/A (no PMA)", None)])
def test_parse_counter_value(text, value):
    assert parse_counter_value(text) == value


def test_pure_deltas_ignore_new_ports_and_counters():
    d, resets = counter_deltas({"a/1": {"x": 1}}, {"a/1": {"x": 4, "y": 9}, "b/1": {"x": 1}})
    assert d == {"a/1": {"x": 3}} and resets == []


def test_check_incomplete_cases(tmp_path):
    assert check_efa_counters(Observations(), inp(max_rx_drops=0))[0].severity is Severity.INCOMPLETE
    none = read_efa_counters(str(tmp_path / "empty"), None)
    assert check_efa_counters(Observations(efa_counters=none), inp(max_rx_drops=0))[0].severity is Severity.INCOMPLETE
    # without a threshold there is nothing to judge: skipped, so a node without counters is never escalated
    assert check_efa_counters(Observations(efa_counters=none), inp())[0].severity is Severity.SKIP
    dgx = CheckInput(profile=load_profile("dgx-h100-ib"), params={})
    assert check_efa_counters(Observations(efa_counters=none), dgx)[0].severity is Severity.SKIP
