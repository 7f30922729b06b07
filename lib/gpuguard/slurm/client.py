"""Talking to Slurm: a `SlurmClient` seam with a CLI implementation (always available, bounded by
timeouts, version-agnostic) and a pyslurm one (only when pyslurm is installed and built for the
running Slurm: pyslurm is pinned to one Slurm major.minor, e.g. pyslurm 23.2.x <-> Slurm 23.02).

Ownership rules (DESIGN §3) live in `drain_node`: gpuguard never overwrites a reason it did not write
and never touches a node that is down or in a maintenance reservation. What scontrol and sinfo print is parsed
in gpuguard.slurm.parse.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import threading
from typing import Optional, Protocol

from gpuguard.config.sections.slurm import SlurmConfig
from gpuguard.slurm.parse import (SINFO_CENSUS_FIELDS, SINFO_CENSUS_FORMAT, NodeRow, NodeState,
                                  node_state_from_fields, parse_node_line, parse_sinfo_census,
                                  parse_sinfo_census_fields)
from gpuguard.slurm.reason import is_ours, is_slurm_generic
from gpuguard.util.toolrun import run_tool
from gpuguard.util.record import Record, record

# NodeState and NodeRow (gpuguard.slurm.parse) are what the clients return: importers may take them from here.


class SlurmError(RuntimeError):
    pass


class SlurmTimeout(SlurmError):
    pass


class SlurmClient(Protocol):
    def get_node(self, name: str) -> Optional[NodeState]: ...

    def drain(self, name: str, reason: str) -> None: ...

    def undrain(self, name: str) -> None: ...

    def set_reason(self, name: str, reason: str) -> None: ...

    def set_comment(self, name: str, comment: str) -> None: ...

    def reboot(self, name: str, reason: str) -> None: ...

    def census(self) -> list["NodeRow"]: ...


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
        """Every node of every partition with its state, reason and Comment: one `sinfo` call (a Slurm whose sinfo
        cannot print Comment: a second one without)."""
        try:
            return parse_sinfo_census_fields(self._run(self.sinfo, ["-h", "-N", "-O", SINFO_CENSUS_FIELDS]))
        except SlurmTimeout:
            raise
        except SlurmError as e:
            if "cannot run" in str(e):
                raise
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

    def set_comment(self, name: str, comment: str) -> None:
        self.run(["update", f"NodeName={name}", f"Comment={comment}"])

    def reboot(self, name: str, reason: str) -> None:
        # ASAP: drain now, reboot once idle; nextstate=RESUME: back in service after the reboot, where the
        # prolog and the health check judge it again. Needs RebootProgram in slurm.conf.
        self.run(["reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", name])


# --------------------------------------------------------------------------- pyslurm client


class PyslurmClient:
    """pyslurm >= 23.2 object API. Used only when `pyslurm_usable()` says it matches the running Slurm."""

    def __init__(self, timeout_s: float = 5.0, sinfo: str = "sinfo") -> None:
        importlib.import_module("pyslurm")  # fails fast when absent

        self.timeout_s = timeout_s
        self.sinfo = sinfo

    def _bounded(self, fn, *args):  # type: ignore[no-untyped-def]
        # libslurm calls block on slurmctld; run them in a daemon thread so the deadline still holds.
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
        import pyslurm  # optional (and pinned to one Slurm release): imported where used, never at module level

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
        import pyslurm  # optional dependency

        self._bounded(lambda: pyslurm.Node(name).modify(state="DRAIN", reason=reason))

    def undrain(self, name: str) -> None:
        import pyslurm  # optional dependency

        self._bounded(lambda: pyslurm.Node(name).modify(state="UNDRAIN"))

    def set_reason(self, name: str, reason: str) -> None:
        import pyslurm  # optional dependency

        self._bounded(lambda: pyslurm.Node(name).modify(reason=reason))

    def set_comment(self, name: str, comment: str) -> None:
        CliSlurmClient(timeout_s=self.timeout_s).set_comment(name, comment)

    def reboot(self, name: str, reason: str) -> None:
        # pyslurm has no stable reboot API across releases; scontrol is always there
        CliSlurmClient(timeout_s=self.timeout_s).reboot(name, reason)

    def census(self) -> list[NodeRow]:
        return CliSlurmClient(timeout_s=self.timeout_s, sinfo=self.sinfo).census()


def pyslurm_usable(slurm_version: Optional[str]) -> bool:
    """pyslurm X.Y.* is built for Slurm X.0Y; anything else would misread structures, so refuse it."""
    try:
        import pyslurm  # optional dependency
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
    env = {**os.environ, "SLURM_CONF": slurm_conf} if slurm_conf else None
    run = run_tool([scontrol, "--version"], timeout_s, env=env)
    return run.text().strip() or None if run.ok else None


def find_sinfo(scontrol: str = "scontrol", sinfo: Optional[str] = None) -> str:
    """The sinfo to run: `sinfo` when configured; the one beside `scontrol` when that is a path with a sinfo in its
    directory (/opt/slurm/bin/scontrol); else plain "sinfo", found on PATH like scontrol (a site whose scontrol is a
    wrapper script has no sinfo beside it)."""
    if sinfo:
        return sinfo
    beside = os.path.join(os.path.dirname(scontrol), "sinfo") if os.path.dirname(scontrol) else ""
    if beside and os.access(beside, os.X_OK):
        return beside
    return "sinfo"  # util.toolrun looks it up on PATH (slurmd gives hooks none: its default PATH then)


def make_client(backend: str = "auto", scontrol: str = "scontrol", timeout_s: float = 5.0,
                slurm_conf: Optional[str] = None, sinfo: Optional[str] = None) -> SlurmClient:
    """`cli` always works. `pyslurm` / `auto` use pyslurm only when it is installed *and* built for the
    running Slurm major.minor (checked against `scontrol --version`); `auto` falls back to the CLI."""
    if backend != "cli":
        if importlib.util.find_spec("pyslurm") is not None and \
                pyslurm_usable(running_slurm_version(scontrol, min(timeout_s, 2.0), slurm_conf)):
            return PyslurmClient(timeout_s, sinfo=find_sinfo(scontrol, sinfo))
        if backend == "pyslurm":
            raise SlurmError("slurm.backend is pyslurm but pyslurm is not installed or not built for this Slurm")
    return CliSlurmClient(scontrol, timeout_s, slurm_conf, sinfo=find_sinfo(scontrol, sinfo))


def client_from_config(slurm_cfg: SlurmConfig, timeout_s: float) -> SlurmClient:
    """The client the `slurm:` config section asks for."""
    return make_client(slurm_cfg.backend, slurm_cfg.scontrol, timeout_s=timeout_s, slurm_conf=slurm_cfg.conf,
                       sinfo=slurm_cfg.sinfo)


# --------------------------------------------------------------------------- ownership-safe drain


def request_reboot(client: SlurmClient, node: str, reason: str) -> dict[str, str]:
    """Ask Slurm to reboot a node gpuguard just drained for a reboot-class fault. Never raises."""
    try:
        client.reboot(node, reason)
    except SlurmError as e:
        return {"outcome": "failed", "detail": str(e)}
    return {"outcome": "requested", "detail": "scontrol reboot ASAP nextstate=RESUME"}


@record
class DrainOutcome(Record):
    outcome: str  # done | already | foreign | failed | skipped
    detail: str = ""
    previous_reason: Optional[str] = None


def drain_node(client: SlurmClient, node: str, reason: str, state: Optional[NodeState] = None) -> DrainOutcome:
    """Drain `node` with `reason` unless someone else owns its state. Never raises. `state`: the node as the caller
    just read it (saves the RPC). A reason Slurm wrote itself (`Prolog error`, `Not responding`, ...) is nobody's:
    gpuguard holds the evidence, so its own reason replaces it (and a DOWN node gets the drain flag, so that it
    does not return to service by itself)."""
    if state is None:
        try:
            state = client.get_node(node)
        except SlurmError as e:
            return DrainOutcome("failed", f"reading node state: {e}")
    if state is None:
        return DrainOutcome("failed", f"node {node} unknown to Slurm")
    if state.maintenance:
        return DrainOutcome("foreign", f"node in maintenance/reboot ({'+'.join(sorted(state.states))}); not touched",
                            state.reason)
    generic = is_slurm_generic(state.reason)
    if state.down and not generic:  # whoever or whatever downed it (slurmctld, an admin) owns it now
        return DrainOutcome("foreign", "node is DOWN; not touched", state.reason)
    if state.drained and not generic:
        if is_ours(state.reason):
            return DrainOutcome("already", "already drained by gpuguard; first reason kept", state.reason)
        if state.reason:
            return DrainOutcome("foreign", "drained by someone else; reason kept", state.reason)
    try:
        client.drain(node, reason)
    except SlurmError as e:
        return DrainOutcome("failed", str(e), state.reason)
    return DrainOutcome("done", f"replaced Slurm's own reason {state.reason!r}" if generic else "", state.reason)
