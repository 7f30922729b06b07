"""Slurm client: ownership rules (property-based), the CLI client's bounds, pyslurm version pinning."""

from __future__ import annotations

import sys
import time
import types
from typing import Optional

import pytest
from hypothesis import given, strategies as st

from gpuguard.slurm.reason import format_reason, is_ours
from gpuguard.slurm.client import CliSlurmClient, NodeState, SlurmError, SlurmTimeout, drain_node, pyslurm_usable
from gpuguard.slurm.parse import node_state_from_fields, parse_node_line

OURS = format_reason("gpu.xid", "XID79", "GPU has fallen off the bus on 0000:86:00", "prolog", "reboot")


class RecordingClient:
    """The SlurmClient seam: a node in a given state; records what gpuguard asks Slurm to do."""

    def __init__(self, state: Optional[NodeState], fail: Optional[Exception] = None) -> None:
        self.state = state
        self.fail = fail
        self.calls: list[tuple[str, str]] = []

    def get_node(self, name: str) -> Optional[NodeState]:
        if self.fail:
            raise self.fail
        return self.state

    def drain(self, name: str, reason: str) -> None:
        self.calls.append(("drain", reason))

    def undrain(self, name: str) -> None:
        self.calls.append(("undrain", name))


def node(state: str, reason: Optional[str] = None) -> NodeState:
    line = f"NodeName=n1 State={state}" + (f" Reason={reason} [root@2026-11-22T03:22:16]" if reason else "")
    return node_state_from_fields(parse_node_line(line))


def test_healthy_node_is_drained():
    c = RecordingClient(node("IDLE"))
    assert drain_node(c, "n1", OURS).outcome == "done" and c.calls == [("drain", OURS)]


@pytest.mark.parametrize("state,reason,outcome", [
    ("IDLE+DRAIN", "admin: replacing PSU [ticket 42]", "foreign"),
    ("DOWN+DRAIN", "admin: dead dimm", "foreign"),
    ("IDLE+MAINTENANCE+RESERVED", None, "foreign"),
    ("IDLE+DRAIN+MAINTENANCE+RESERVED", "admin: bad dimm", "foreign"),
    ("IDLE+REBOOT_REQUESTED", None, "foreign"),
    ("IDLE+DRAIN", OURS, "already"),
])
def test_never_touches_what_is_not_ours(state, reason, outcome):
    c = RecordingClient(node(state, reason))
    out = drain_node(c, "n1", format_reason("gpu.ecc", "ECC", "x", "prolog"))
    assert out.outcome == outcome and c.calls == []
    assert out.previous_reason == reason


@pytest.mark.parametrize("state,reason", [("MIXED+DRAIN", "Prolog error"), ("DOWN", "Not responding"),
                                          ("IDLE+DRAIN", "Kill task failed"), ("DOWN+DRAIN", "Epilog error")])
def test_slurms_own_reason_is_nobodys_and_gpuguards_replaces_it(state, reason):
    """Issue 27: Slurm's generic reasons are not an admin's. gpuguard holds the evidence, so its reason replaces
    them (a DOWN node gets the drain flag too, so it does not return to service by itself)."""
    c = RecordingClient(node(state, reason))
    out = drain_node(c, "n1", OURS)
    assert out.outcome == "done" and c.calls == [("drain", OURS)] and out.previous_reason == reason
    assert reason in out.detail


def test_user_reservation_does_not_protect_a_broken_node():
    c = RecordingClient(node("IDLE+RESERVED"))
    assert drain_node(c, "n1", OURS).outcome == "done"


def test_slurm_unreachable_is_a_failed_drain_not_an_exception():
    out = drain_node(RecordingClient(None, fail=SlurmTimeout("scontrol show did not answer within 5s")), "n1", OURS)
    assert out.outcome == "failed" and "did not answer" in out.detail
    assert drain_node(RecordingClient(None), "n1", OURS).outcome == "failed"


STATES = st.lists(st.sampled_from(["IDLE", "MIXED", "ALLOCATED", "DOWN", "DRAIN", "MAINTENANCE", "RESERVED",
                                   "REBOOT_REQUESTED", "NOT_RESPONDING", "COMPLETING"]), min_size=1, max_size=4)
REASONS = st.one_of(st.none(), st.text(min_size=1, max_size=60).filter(lambda r: r.strip() and "\n" not in r),
                    st.just(OURS))


@given(STATES, REASONS)
def test_ownership_rules_hold_for_any_state(states, reason):
    """Whatever state and reason a node has, gpuguard only ever drains a node that is neither down, in
    maintenance nor drained by someone else, and never overwrites a reason it did not write."""
    st_ = NodeState("n1", frozenset(states), reason=reason)
    c = RecordingClient(st_)
    out = drain_node(c, "n1", OURS)
    if c.calls:
        assert out.outcome == "done"
        assert not st_.maintenance
        assert not st_.down
        assert not (st_.drained and reason and not is_ours(reason))
        assert not (st_.drained and is_ours(reason))
    if reason and not is_ours(reason) and (st_.drained or st_.down):
        assert c.calls == []


def _stub(tmp_path, body: str) -> str:
    p = tmp_path / "scontrol"
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)
    return str(p)


def test_cli_client_times_out_on_a_hung_scontrol(tmp_path):
    c = CliSlurmClient(_stub(tmp_path, "sleep 30\n"), timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(SlurmTimeout):
        c.get_node("n1")
    assert time.monotonic() - t0 < 2


def test_cli_client_passes_reason_as_one_argument(tmp_path):
    log = tmp_path / "args"
    c = CliSlurmClient(_stub(tmp_path, f'for a in "$@"; do printf "%s\\n" "$a" >> {log}; done\n'),
                       slurm_conf="/etc/slurm/x.conf")
    hostile = "gpuguard: NVML gpu.nvml: $(reboot) `id` ; rm -rf / [prolog]"
    c.drain("node7", hostile)
    assert log.read_text().splitlines() == ["update", "NodeName=node7", "State=DRAIN", f"Reason={hostile}"]


def test_cli_client_reports_errors(tmp_path):
    c = CliSlurmClient(_stub(tmp_path, 'echo "slurm_update error: Invalid node state specified" >&2; exit 1\n'))
    with pytest.raises(SlurmError, match="Invalid node state"):
        c.drain("n1", OURS)
    assert CliSlurmClient(_stub(tmp_path, 'echo "Node nX not found" >&2; exit 1\n')).get_node("nX") is None


@pytest.mark.parametrize("pyslurm_version,slurm,ok", [
    ("23.2.2", "slurm 23.02.7", True), ("25.11.0", "slurm 25.11.1", True),
    ("23.2.2", "slurm 22.05.8", False), ("25.11.0", "slurm 24.11.3", False), ("23.2.2", None, False),
])
def test_pyslurm_is_used_only_for_its_own_slurm(monkeypatch, pyslurm_version, slurm, ok):
    fake = types.ModuleType("pyslurm")
    fake.__version__ = pyslurm_version  # type: ignore[attr-defined]
    fake.Node = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    assert pyslurm_usable(slurm) is ok


def test_reboot_request_argv_and_failure(tmp_path):
    from gpuguard.slurm.client import request_reboot

    log = tmp_path / "args"
    c = CliSlurmClient(_stub(tmp_path, f'for a in "$@"; do printf "%s\\n" "$a" >> {log}; done\n'))
    assert request_reboot(c, "node3", OURS)["outcome"] == "requested"
    assert log.read_text().splitlines() == ["reboot", "ASAP", "nextstate=RESUME", f"reason={OURS}", "node3"]
    bad = CliSlurmClient(_stub(tmp_path, 'echo "RebootProgram isn\'t defined" >&2; exit 1\n'))
    out = request_reboot(bad, "node3", OURS)
    assert out["outcome"] == "failed" and "RebootProgram" in out["detail"]
