"""Talking to Slurm: a `SlurmClient` seam with a CLI implementation (always available, bounded by
timeouts, version-agnostic) and a pyslurm one (only when pyslurm is installed and built for the
running Slurm: pyslurm is pinned to one Slurm major.minor, e.g. pyslurm 23.2.x <-> Slurm 23.02).

Ownership rules (DESIGN §3) live in `drain_node`: gpuguard never overwrites a reason it did not write
and never touches a node that is down or in a maintenance reservation.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from typing import Optional, Protocol

from gpuguard.reason import is_ours


class SlurmError(RuntimeError):
    pass


class SlurmTimeout(SlurmError):
    pass


@dataclass
class NodeState:
    name: str
    states: frozenset[str] = frozenset()  # {"IDLE", "DRAIN", ...} from State=IDLE+DRAIN
    reason: Optional[str] = None  # the reason text without Slurm's " [user@time]" suffix
    reason_user: Optional[str] = None
    reason_time: Optional[str] = None
    boot_time: Optional[str] = None
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def drained(self) -> bool:
        return bool({"DRAIN", "DRAINED", "DRAINING"} & self.states)

    @property
    def down(self) -> bool:
        return "DOWN" in self.states

    @property
    def maintenance(self) -> bool:
        return bool({"MAINT", "RESERVED", "REBOOT_REQUESTED", "REBOOT_ISSUED"} & self.states)


class SlurmClient(Protocol):
    def get_node(self, name: str) -> Optional[NodeState]: ...

    def drain(self, name: str, reason: str) -> None: ...

    def undrain(self, name: str) -> None: ...


# --------------------------------------------------------------------------- parsing `scontrol show node -o`

# Keys Slurm prints after Reason= (22.05 .. 25.x). Inside a reason only these end the value, so a free-text
# reason containing "x=y" is not cut short.
_AFTER_REASON_KEYS = {"Comment", "Extra", "ResumeAfterTime", "ExtSensorsJoules", "ExtSensorsWatts",
                      "ExtSensorsTemp", "CapWatts", "CurrentWatts", "AveWatts", "LastBusyTime", "Reservation",
                      "InstanceId", "InstanceType", "Topology", "GresDrain", "GresUsed", "NodeName", "MCS_label",
                      "Partitions", "BootTime", "SlurmdStartTime", "CfgTRES", "AllocTRES", "Owner", "Weight"}
_KEY_TOKEN = re.compile(r"^([A-Z][A-Za-z_]*)=(.*)$", re.S)
_REASON_SUFFIX = re.compile(r"^(.*?)\s*\[([^\[\]@]+)@([^\[\]]+)\]\s*$", re.S)


def parse_node_line(line: str) -> dict[str, str]:
    """One line of `scontrol show node -o` -> {key: value}. Values may contain spaces (Reason, OS)."""
    out: dict[str, str] = {}
    key: Optional[str] = None
    for token in line.strip().split(" "):
        m = _KEY_TOKEN.match(token)
        starts_field = bool(m) and (key != "Reason" or m.group(1) in _AFTER_REASON_KEYS)  # type: ignore[union-attr]
        if m and starts_field:
            key = m.group(1)
            out[key] = m.group(2)
        elif key is not None:
            out[key] += " " + token
    return out


def node_state_from_fields(f: dict[str, str]) -> NodeState:
    state = f.get("State", "")
    states = frozenset(s for s in re.split(r"[+*~#!%$@^-]+", state.upper()) if s)
    if state.endswith("*"):
        states = states | {"NOT_RESPONDING"}
    reason = f.get("Reason")
    user = when = None
    if reason is not None:
        m = _REASON_SUFFIX.match(reason)
        if m:
            reason, user, when = m.group(1), m.group(2), m.group(3)
        if reason in ("", "(null)", "None"):
            reason = None
    return NodeState(name=f.get("NodeName", ""), states=states, reason=reason, reason_user=user,
                     reason_time=when, boot_time=f.get("BootTime"), fields=f)


# --------------------------------------------------------------------------- CLI client


class CliSlurmClient:
    """scontrol, every call bounded by a timeout (slurmctld may be down or the node not registered yet)."""

    def __init__(self, scontrol: str = "scontrol", timeout_s: float = 5.0) -> None:
        self.scontrol = scontrol
        self.timeout_s = timeout_s

    def _run(self, args: list[str], timeout_s: Optional[float] = None) -> str:
        import subprocess

        exe = shutil.which(self.scontrol) or self.scontrol
        t = self.timeout_s if timeout_s is None else timeout_s
        try:
            # argv list, never a shell: reasons and node names are data, not code
            p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=t,
                               stdin=subprocess.DEVNULL, errors="replace")
        except subprocess.TimeoutExpired:
            raise SlurmTimeout(f"scontrol {args[0]} did not answer within {t:g}s") from None
        except OSError as e:
            raise SlurmError(f"cannot run {self.scontrol}: {e.strerror}") from None
        if p.returncode != 0:
            raise SlurmError(f"scontrol {' '.join(args[:2])} failed ({p.returncode}): "
                             f"{(p.stderr or p.stdout).strip()[:300]}")
        return p.stdout

    def get_node(self, name: str) -> Optional[NodeState]:
        try:
            out = self._run(["show", "node", name, "-o"])
        except SlurmError as e:
            if "not found" in str(e).lower() or "invalid node name" in str(e).lower():
                return None
            raise
        for line in out.splitlines():
            if line.startswith("NodeName="):
                return node_state_from_fields(parse_node_line(line))
        return None

    def drain(self, name: str, reason: str) -> None:
        self._run(["update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}"])

    def undrain(self, name: str) -> None:
        # UNDRAIN clears only the drain flag (a DOWN node stays DOWN), unlike RESUME.
        self._run(["update", f"NodeName={name}", "State=UNDRAIN"])

    def set_reason(self, name: str, reason: str) -> None:
        self._run(["update", f"NodeName={name}", f"Reason={reason}"])


# --------------------------------------------------------------------------- pyslurm client


class PyslurmClient:
    """pyslurm >= 23.2 object API. Used only when `pyslurm_usable()` says it matches the running Slurm."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        import pyslurm  # noqa: F401 - fails fast when absent

        self.timeout_s = timeout_s

    def _bounded(self, fn, *args):  # type: ignore[no-untyped-def]
        # libslurm calls block on slurmctld; run them in a daemon thread so the deadline still holds.
        import threading

        result: dict[str, object] = {}

        def target() -> None:
            try:
                result["value"] = fn(*args)
            except Exception as e:  # noqa: BLE001
                result["error"] = e

        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            raise SlurmTimeout(f"pyslurm call did not return within {self.timeout_s:g}s")
        if "error" in result:
            raise SlurmError(f"pyslurm: {result['error']}")
        return result.get("value")

    def get_node(self, name: str) -> Optional[NodeState]:
        import pyslurm

        def load() -> Optional[NodeState]:
            try:
                n = pyslurm.Node.load(name)
            except pyslurm.RPCError:
                return None
            state = "+".join([str(n.state)] + [str(s) for s in (n.state_flags or [])]) if hasattr(n, "state_flags") \
                else str(n.state)
            return node_state_from_fields({"NodeName": name, "State": state, "Reason": n.reason or ""})

        return self._bounded(load)  # type: ignore[no-any-return]

    def drain(self, name: str, reason: str) -> None:
        import pyslurm

        self._bounded(lambda: pyslurm.Node(name).modify(pyslurm.Node(state="DRAIN", reason=reason)))

    def undrain(self, name: str) -> None:
        import pyslurm

        self._bounded(lambda: pyslurm.Node(name).modify(pyslurm.Node(state="UNDRAIN")))


def pyslurm_usable(slurm_version: Optional[str]) -> bool:
    """pyslurm X.Y.* is built for Slurm X.0Y; anything else would misread structures, so refuse it."""
    try:
        import pyslurm
    except Exception:  # noqa: BLE001 - ImportError, or a libslurm ABI mismatch at load time
        return False
    version = getattr(pyslurm, "__version__", "")
    m = re.match(r"(\d+)\.(\d+)", version)
    s = re.match(r"(?:slurm\s+)?(\d+)\.(\d+)", slurm_version or "")
    if not m or not s or not hasattr(pyslurm, "Node"):
        return False
    return int(m.group(1)) == int(s.group(1)) and int(m.group(2)) == int(s.group(2))


def make_client(backend: str = "auto", scontrol: str = "scontrol", timeout_s: float = 5.0,
                slurm_version: Optional[str] = None) -> SlurmClient:
    if backend == "pyslurm" or (backend == "auto" and slurm_version and pyslurm_usable(slurm_version)):
        if backend == "pyslurm" and not pyslurm_usable(slurm_version or "0.0"):
            raise SlurmError("slurm.backend is pyslurm but pyslurm is not installed or not built for this Slurm")
        return PyslurmClient(timeout_s)
    return CliSlurmClient(scontrol, timeout_s)


# --------------------------------------------------------------------------- ownership-safe drain


@dataclass
class DrainOutcome:
    outcome: str  # done | already | foreign | failed | skipped
    detail: str = ""
    previous_reason: Optional[str] = None


def drain_node(client: SlurmClient, node: str, reason: str) -> DrainOutcome:
    """Drain `node` with `reason` unless someone else owns its state. Never raises."""
    try:
        state = client.get_node(node)
    except SlurmError as e:
        return DrainOutcome("failed", f"reading node state: {e}")
    if state is None:
        return DrainOutcome("failed", f"node {node} unknown to Slurm")
    if state.maintenance:
        return DrainOutcome("foreign", f"node in maintenance/reboot ({'+'.join(sorted(state.states))}); not touched",
                            state.reason)
    if state.drained or state.down:
        if state.reason and not is_ours(state.reason):
            return DrainOutcome("foreign", "drained/down by someone else; reason kept", state.reason)
        if state.drained and is_ours(state.reason):
            return DrainOutcome("already", "already drained by gpuguard; first reason kept", state.reason)
        if state.down and not state.drained:
            return DrainOutcome("foreign", "node is DOWN; not touched", state.reason)
    try:
        client.drain(node, reason)
    except SlurmError as e:
        return DrainOutcome("failed", str(e), state.reason)
    return DrainOutcome("done", "", state.reason)
