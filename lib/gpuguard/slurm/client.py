"""Talking to Slurm: a `SlurmClient` seam with a CLI implementation (always available, bounded by
timeouts, version-agnostic) and a pyslurm one (only when pyslurm is installed and built for the
running Slurm: pyslurm is pinned to one Slurm major.minor, e.g. pyslurm 23.2.x <-> Slurm 23.02).

Ownership rules (DESIGN §3) live in `drain_node`: gpuguard never overwrites a reason it did not write
and never touches a node that is down or in a maintenance reservation.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional, Protocol

from gpuguard.slurm.reason import is_ours


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
        # An admin's maintenance reservation or a pending reboot: hands off. A plain (user) reservation is not:
        # a broken node in a big run's reservation must still be drained.
        return bool({"MAINTENANCE", "MAINT", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWERING_DOWN"} & self.states)


class SlurmClient(Protocol):
    def get_node(self, name: str) -> Optional[NodeState]: ...

    def drain(self, name: str, reason: str) -> None: ...

    def undrain(self, name: str) -> None: ...

    def set_reason(self, name: str, reason: str) -> None: ...

    def reboot(self, name: str, reason: str) -> None: ...

    def census(self) -> list["NodeRow"]: ...


# --------------------------------------------------------------------------- parsing `scontrol show ... -o`
# Verified on 22.05 (see devcluster.py): Reason comes last, verbatim (spaces, ':', '=', '[...]' unescaped),
# followed by Slurm's " [user@time]" stamp. Parse the plain -o form: every Slurm version prints it.

# A key as `scontrol show ... -o` prints them: `NodeName`, `Socks/Node`, `ReqB:S:C:T`, `NtasksPerN:B:S:C`.
_KEY_AT = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
# Slurm appends who set a node's reason and when: `Reason=Prolog error [root@2024-05-01T10:00:00]`.
_REASON_STAMP = re.compile(r"\s\[([^\[\]\s@]+)@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d|Unknown|None)\]")


def _split_fields(text: str) -> dict[str, str]:
    """Split `Key=value Key2=value with spaces` at each ` Key=`; the first occurrence of a key wins.

    A value containing ` Word=` is split wrongly here; callers fix the free-text fields they know about.
    """
    line = " ".join(text.strip().splitlines())
    fields: dict[str, str] = {}
    matches = list(_KEY_AT.finditer(line))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        fields.setdefault(match.group(1), line[match.end() : end].rstrip())
    return fields


def parse_node_line(text: str) -> dict[str, str]:
    """Parse one node of `scontrol show node -o` into {key: value}.

    `Reason` is free text an admin typed (spaces, `=`, `:` and `[...]` allowed), so it is cut out first, up to the
    ` [user@time]` stamp Slurm appends; the stamp goes to `ReasonUser` / `ReasonTime`. Everything after the stamp
    (e.g. `Comment=`) is parsed normally.
    """
    line = " ".join(text.strip().splitlines())
    reason_at = re.search(r"(?:^|\s)Reason=", line)
    if reason_at is None:
        return _split_fields(line)
    head, tail = line[: reason_at.start()], line[reason_at.end() :]
    fields = _split_fields(head)
    stamp = _stamp_ending_reason(tail)
    if stamp is None:
        # No stamp (not seen in 22.05, but cheap to survive): the reason runs to the end of the line.
        fields["Reason"] = tail.strip()
        return fields
    fields["Reason"] = tail[: stamp.start()].strip()
    fields["ReasonUser"], fields["ReasonTime"] = stamp.group(1), stamp.group(2)
    for key, value in _split_fields(tail[stamp.end() :]).items():
        fields.setdefault(key, value)
    return fields


def _stamp_ending_reason(tail: str) -> Optional[re.Match[str]]:
    """The first `[user@time]` stamp that is followed by the end of the line or by another ` Key=`."""
    for stamp in _REASON_STAMP.finditer(tail):
        rest = tail[stamp.end() :]
        if not rest.strip() or _KEY_AT.match(rest.lstrip()):
            return stamp
    return None


def parse_node_lines(text: str) -> dict[str, dict[str, str]]:
    """Parse all of `scontrol show node -o` (one node a line) into {node name: fields}."""
    nodes = {}
    for line in text.splitlines():
        if line.strip():
            fields = parse_node_line(line)
            nodes[fields.get("NodeName", "")] = fields
    return nodes


# The user picks a job's name, and scontrol prints it unescaped right before `UserId=name(uid) GroupId=`.
_JOB_NAME = re.compile(r"(?:^|\s)JobName=(.*?) UserId=(\S*\(\d+\)) GroupId=")


def parse_job_line(text: str) -> dict[str, str]:
    """Parse one job of `scontrol show job -o` into {key: value}.

    A value is everything up to the next ` Key=`, so values with spaces (`Command`, paths) are kept whole.
    `JobName` (user-chosen, may even contain ` Key=`) is cut out first, anchored on the `UserId=name(uid)` that
    always follows it. Other free text (`Comment=`) containing ` Key=` cannot be told apart from a real field in
    this format; the first occurrence of each key wins. A job's `Reason` is a fixed word (`BeginTime`, `None`,
    `launch_failed_requeued_held`).
    """
    line = " ".join(text.strip().splitlines())
    name = _JOB_NAME.search(line)
    if name is None:
        return _split_fields(line)
    fields = _split_fields(line[: name.start()])
    fields["JobName"] = name.group(1)
    for key, value in _split_fields(line[name.end(1) :]).items():
        fields.setdefault(key, value)
    return fields


def parse_job_lines(text: str) -> list[dict[str, str]]:
    return [parse_job_line(line) for line in text.splitlines() if line.strip()]


def node_state_flags(state: str) -> set[str]:
    """`IDLE+DRAIN+MAINTENANCE+RESERVED` -> {"IDLE", "DRAIN", "MAINTENANCE", "RESERVED"} (Slurm's `*` suffix =
    not responding)."""
    flags = {part for part in state.rstrip("*").split("+") if part}
    if state.endswith("*"):
        flags.add("NOT_RESPONDING")
    return flags


def node_state_from_fields(f: dict[str, str]) -> NodeState:
    reason = f.get("Reason")
    if reason in ("", "(null)", "None"):
        reason = None
    return NodeState(name=f.get("NodeName", ""), states=frozenset(node_state_flags(f.get("State", ""))),
                     reason=reason, reason_user=f.get("ReasonUser"), reason_time=f.get("ReasonTime"),
                     boot_time=f.get("BootTime"), fields=f)


@dataclass(frozen=True)
class NodeRow:
    """One node in one partition, as `sinfo -N` lists it: what the drain-storm guard counts."""

    node: str
    partition: str
    state: str  # sinfo's long state, lower case: idle, drained, draining, mixed, down*, ...
    reason: Optional[str]
    reason_time: Optional[str]  # 2026-11-25T18:35:50 (local time, as Slurm prints it) or None

    @property
    def drained(self) -> bool:
        return "drain" in self.state


def slurm_time(text: Optional[str]) -> Optional[float]:
    """Slurm's `ReasonTime=2026-11-24T17:53:20` (printed in local time, no zone) -> epoch seconds."""
    if not text or text in ("None", "Unknown", "(null)"):
        return None
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp()  # naive: local time, as Slurm printed it
    except ValueError:
        return None


# Node name, partition, long state, reason time, reason (last: free text that may hold the separator).
SINFO_CENSUS_FORMAT = "%N|%P|%T|%H|%E"


def parse_sinfo_census(text: str) -> list[NodeRow]:
    """`sinfo -h -N -o '%N|%P|%T|%H|%E'` -> rows. The default partition's `*` is dropped; 'none'/'Unknown' are
    no reason / no time."""
    rows = []
    for line in text.splitlines():
        parts = line.rstrip("\n").split("|", 4)
        if len(parts) != 5 or not parts[0].strip():
            continue
        node, part, state, when, reason = (x.strip() for x in parts)
        rows.append(NodeRow(node=node, partition=part.rstrip("*"), state=state.lower(),
                            reason=None if reason in ("", "none", "(null)") else reason,
                            reason_time=None if when in ("", "Unknown", "None", "(null)") else when))
    return rows


# --------------------------------------------------------------------------- CLI client


class CliSlurmClient:
    """scontrol, every call bounded by a timeout (slurmctld may be down or the node not registered yet)."""

    def __init__(self, scontrol: str = "scontrol", timeout_s: float = 5.0, slurm_conf: Optional[str] = None,
                 sinfo: str = "sinfo") -> None:
        self.scontrol = scontrol
        self.sinfo = sinfo
        self.timeout_s = timeout_s
        # The HealthCheckProgram gets no SLURM_CONF from slurmd (only SLURMD_NODENAME): config can supply it.
        self.slurm_conf = slurm_conf

    def run(self, args: list[str], timeout_s: Optional[float] = None) -> str:
        """`scontrol ARGS...` (bounded, argv only); its stdout, or SlurmError/SlurmTimeout."""
        return self._run(self.scontrol, args, timeout_s)

    def _run(self, exe: str, args: list[str], timeout_s: Optional[float] = None) -> str:
        from gpuguard.util.toolrun import run_tool

        t = self.timeout_s if timeout_s is None else timeout_s
        env = {**os.environ, "SLURM_CONF": self.slurm_conf} if self.slurm_conf else None
        # argv list, never a shell: reasons and node names are data, not code
        run = run_tool([exe, *args], t, env=env)
        name = os.path.basename(exe)
        if run.timed_out:
            raise SlurmTimeout(f"{name} {args[0]} did not answer within {t:g}s")
        if run.rc is None:
            raise SlurmError(f"cannot run {exe}: {run.error}")
        if run.rc != 0:
            msg = (run.stderr or run.stdout).decode("utf-8", errors="replace").strip()
            raise SlurmError(f"{name} {' '.join(args[:2])} failed ({run.rc}): {msg[:300]}")
        return run.text()

    def census(self) -> list[NodeRow]:
        """Every node of every partition with its state and reason: one `sinfo` call."""
        return parse_sinfo_census(self._run(self.sinfo, ["-h", "-N", "-o", SINFO_CENSUS_FORMAT]))

    def get_node(self, name: str) -> Optional[NodeState]:
        try:
            out = self.run(["show", "node", name, "-o"])
        except SlurmError as e:
            if "not found" in str(e).lower() or "invalid node name" in str(e).lower():
                return None
            raise
        for line in out.splitlines():
            if line.startswith("NodeName="):
                return node_state_from_fields(parse_node_line(line))
        return None

    def drain(self, name: str, reason: str) -> None:
        self.run(["update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}"])

    def undrain(self, name: str) -> None:
        # UNDRAIN clears only the drain flag (a DOWN node stays DOWN), unlike RESUME.
        self.run(["update", f"NodeName={name}", "State=UNDRAIN"])

    def set_reason(self, name: str, reason: str) -> None:
        self.run(["update", f"NodeName={name}", f"Reason={reason}"])

    def reboot(self, name: str, reason: str) -> None:
        # ASAP: drain now, reboot once idle; nextstate=RESUME: back in service after the reboot, where the
        # prolog and the health check judge it again. Needs RebootProgram in slurm.conf.
        self.run(["reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", name])


# --------------------------------------------------------------------------- pyslurm client


class PyslurmClient:
    """pyslurm >= 23.2 object API. Used only when `pyslurm_usable()` says it matches the running Slurm."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        import importlib

        importlib.import_module("pyslurm")  # fails fast when absent

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
                # pyslurm >= 23.2 has Node.load(); the 22.x object API only Node(name).reload()
                n = pyslurm.Node.load(name) if hasattr(pyslurm.Node, "load") else pyslurm.Node(name).reload()
            except pyslurm.RPCError:
                return None
            # `state` is slurm_node_state_string_complete(): "IDLE+DRAIN", the same text scontrol prints
            return node_state_from_fields({"NodeName": name, "State": str(n.state or ""),
                                           "Reason": n.reason or ""})

        return self._bounded(load)  # type: ignore[no-any-return]

    def drain(self, name: str, reason: str) -> None:
        import pyslurm

        self._bounded(lambda: pyslurm.Node(name).modify(state="DRAIN", reason=reason))

    def undrain(self, name: str) -> None:
        import pyslurm

        self._bounded(lambda: pyslurm.Node(name).modify(state="UNDRAIN"))

    def set_reason(self, name: str, reason: str) -> None:
        import pyslurm

        self._bounded(lambda: pyslurm.Node(name).modify(reason=reason))

    def reboot(self, name: str, reason: str) -> None:
        # pyslurm has no stable reboot API across releases; scontrol is always there
        CliSlurmClient(timeout_s=self.timeout_s).reboot(name, reason)

    def census(self) -> list[NodeRow]:
        return CliSlurmClient(timeout_s=self.timeout_s).census()


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


def running_slurm_version(scontrol: str = "scontrol", timeout_s: float = 2.0,
                          slurm_conf: Optional[str] = None) -> Optional[str]:
    """`scontrol --version` -> "slurm 22.05.8" (None when it cannot tell in time)."""
    from gpuguard.util.toolrun import run_tool

    env = {**os.environ, "SLURM_CONF": slurm_conf} if slurm_conf else None
    run = run_tool([scontrol, "--version"], timeout_s, env=env)
    return run.text().strip() or None if run.ok else None


def make_client(backend: str = "auto", scontrol: str = "scontrol", timeout_s: float = 5.0,
                slurm_conf: Optional[str] = None) -> SlurmClient:
    """`cli` always works. `pyslurm` / `auto` use pyslurm only when it is installed *and* built for the
    running Slurm major.minor (checked against `scontrol --version`); `auto` falls back to the CLI."""
    if backend != "cli":
        import importlib.util

        if importlib.util.find_spec("pyslurm") is not None and \
                pyslurm_usable(running_slurm_version(scontrol, min(timeout_s, 2.0), slurm_conf)):
            return PyslurmClient(timeout_s)
        if backend == "pyslurm":
            raise SlurmError("slurm.backend is pyslurm but pyslurm is not installed or not built for this Slurm")
    # sinfo beside the configured scontrol (a site that names /opt/slurm/bin/scontrol has its sinfo there too)
    sinfo = os.path.join(os.path.dirname(scontrol), "sinfo") if os.path.dirname(scontrol) else "sinfo"
    return CliSlurmClient(scontrol, timeout_s, slurm_conf, sinfo=sinfo)


def client_from_config(slurm_cfg: dict, timeout_s: float) -> SlurmClient:  # type: ignore[type-arg]
    """The client the `slurm:` config section asks for."""
    return make_client(slurm_cfg["backend"], slurm_cfg["scontrol"], timeout_s=timeout_s, slurm_conf=slurm_cfg["conf"])


# --------------------------------------------------------------------------- ownership-safe drain


def request_reboot(client: SlurmClient, node: str, reason: str) -> dict[str, str]:
    """Ask Slurm to reboot a node gpuguard just drained for a reboot-class fault. Never raises."""
    try:
        client.reboot(node, reason)
    except SlurmError as e:
        return {"outcome": "failed", "detail": str(e)}
    return {"outcome": "requested", "detail": "scontrol reboot ASAP nextstate=RESUME"}


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
    if state.down:  # whoever or whatever downed it (slurmctld, an admin) owns it now
        return DrainOutcome("foreign", "node is DOWN; not touched", state.reason)
    if state.drained:
        if is_ours(state.reason):
            return DrainOutcome("already", "already drained by gpuguard; first reason kept", state.reason)
        if state.reason:
            return DrainOutcome("foreign", "drained by someone else; reason kept", state.reason)
    try:
        client.drain(node, reason)
    except SlurmError as e:
        return DrainOutcome("failed", str(e), state.reason)
    return DrainOutcome("done", "", state.reason)
