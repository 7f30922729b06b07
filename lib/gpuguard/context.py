"""Who is running us and for what: built from Slurm's environment or the command line.

Everything read from the environment is treated as hostile (a job's environment and comment are user
controlled): values are validated and anything malformed is dropped, never interpreted.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

from gpuguard.util.record import Frozen, field, record

KINDS = ("prolog", "epilog", "healthcheck", "manual")

_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_JOB_RE = re.compile(r"^\d{1,12}(?:_\d{1,9})?$")
_USER_RE = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,31}\$?$")
_UID_RE = re.compile(r"^\d{1,10}$")


@record
class RunContext(Frozen):
    kind: str  # prolog | epilog | healthcheck | manual
    node: str
    job_id: Optional[str] = None
    job_user: Optional[str] = None
    job_uid: Optional[int] = None
    gpu_indices: Optional[tuple[int, ...]] = None  # the job's GPUs (NVML indices); None = all GPUs
    # Slurm's own identifiers for the job's GPUs (GRES indices = /dev/nvidiaN minor numbers, or GPU-/MIG- UUIDs);
    # the pipeline maps them to NVML indices (gpuguard.pipeline.gpumap) once NVML has been read. None = not from Slurm.
    gpu_ids: Optional[tuple[str, ...]] = None
    restart_count: int = 0
    exclusive: Optional[bool] = None
    job_exit_code: Optional[int] = None  # epilog: SLURM_JOB_EXIT_CODE2 style "exit:signal" -> raw
    ignored_env: tuple[str, ...] = field(default_factory=tuple)  # env vars that were malformed
    # how a hook came to run, for its result line and metrics: "agent" (the node agent's child), "local(<why the agent
    # that listens did not run it>)", None (its own process: no agent, or not a hook)
    via: Optional[str] = None


def parse_gpu_list(value: Optional[str]) -> Optional[tuple[int, ...]]:
    """'0,1,5' or '0-3,6' -> (0,1,5) / (0,1,2,3,6). Raises ValueError on anything else (UUIDs, junk)."""
    if value is None:
        return None
    value = value.strip()
    if value == "":
        return ()
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d{1,3})(?:-(\d{1,3}))?", part)
        if not m:
            raise ValueError(f"not a GPU index list: {value[:40]!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo or hi - lo > 255:
            raise ValueError(f"bad GPU index range: {part!r}")
        out.extend(range(lo, hi + 1))
    return tuple(sorted(set(out)))


_UUID_TOKEN = re.compile(r"^(?:GPU|MIG)-[0-9A-Fa-f-]{8,64}(?:/\d{1,3}/\d{1,3})?$|^MIG-GPU-[0-9A-Fa-f-]{8,64}/\d{1,3}/\d{1,3}$")


def parse_gpu_ids(value: Optional[str]) -> Optional[tuple[str, ...]]:
    """Slurm's GPU list as identifiers: '0,1,5' / '0-3' (GRES indices) or GPU-/MIG- UUIDs. Raises ValueError on
    anything else (the job environment is user-controlled)."""
    if value is None:
        return None
    value = value.strip()
    if value == "":
        return ()
    if any(c.isalpha() for c in value):
        tokens = [t.strip() for t in value.split(",")]
        if len(tokens) > 256 or not all(_UUID_TOKEN.match(t) for t in tokens):
            raise ValueError(f"not a GPU id list: {value[:40]!r}")
        return tuple(dict.fromkeys(tokens))
    return tuple(str(i) for i in parse_gpu_list(value) or ())


def _short_hostname() -> str:
    return os.uname().nodename.split(".")[0]  # what socket.gethostname() returns, without importing socket


def context_from_env(kind: str, env: Mapping[str, str], node: Optional[str] = None) -> RunContext:
    """Build the context slurmd gives a Prolog/Epilog/HealthCheckProgram."""
    if kind not in KINDS:
        raise ValueError(f"unknown run kind {kind!r}")
    read = _HostileEnv(env)
    node_name = node or read.pick("SLURMD_NODENAME", _NODE_RE) or _short_hostname()
    job_id = read.pick("SLURM_JOB_ID", _JOB_RE) or read.pick("SLURM_JOBID", _JOB_RE)
    user = read.pick("SLURM_JOB_USER", _USER_RE)
    uid_s = read.pick("SLURM_JOB_UID", _UID_RE)
    gpus: Optional[tuple[int, ...]] = None
    gpu_ids: Optional[tuple[str, ...]] = None
    if kind in ("prolog", "epilog"):
        gpus, gpu_ids = read.job_gpus(job_id)
    return RunContext(
        kind=kind,
        node=node_name,
        job_id=job_id,
        job_user=user,
        job_uid=int(uid_s) if uid_s is not None else None,
        gpu_indices=gpus,
        gpu_ids=gpu_ids,
        restart_count=read.restart_count(),
        exclusive=read.exclusive(),
        job_exit_code=read.job_exit_code(),
        ignored_env=tuple(read.ignored),
    )


class _HostileEnv:
    """Reads Slurm's variables from a job-controlled environment: a value that does not match what Slurm writes is
    dropped and its name remembered (`ignored`, in the order read), never interpreted."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.ignored: list[str] = []

    def pick(self, name: str, pattern: re.Pattern[str]) -> Optional[str]:
        v = self.env.get(name)
        if v is None or v == "":
            return None
        if pattern.match(v):
            return v
        self.ignored.append(name)
        return None

    def job_gpus(self, job_id: Optional[str]) -> tuple[Optional[tuple[int, ...]], Optional[tuple[str, ...]]]:
        """(provisional NVML indices, Slurm's GPU ids) of the job's GPUs.

        Slurm sets SLURM_JOB_GPUS (GRES indices) and CUDA_VISIBLE_DEVICES in the prolog; UUIDs (a MIG slice's
        MIG-... in CUDA_VISIBLE_DEVICES) name a GPU more precisely than an index, so they win."""
        parsed: dict[str, tuple[str, ...]] = {}
        for var in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
            if var in self.env:
                try:
                    ids = parse_gpu_ids(self.env[var])
                except ValueError:
                    self.ignored.append(var)
                    continue
                if ids is not None:
                    parsed[var] = ids
        with_uuid = next((ids for ids in parsed.values() if any(not i.isdigit() for i in ids)), None)
        gpu_ids = with_uuid if with_uuid is not None else next(iter(parsed.values()), None)
        gpus: Optional[tuple[int, ...]] = None
        if gpu_ids is not None and all(i.isdigit() for i in gpu_ids):
            gpus = tuple(int(i) for i in gpu_ids)  # provisional: Slurm's indices until the pipeline maps them
        # A job without GPUs: node-level checks still run, per-GPU checks have nothing to look at.
        if gpu_ids is None and job_id is not None:
            gpus, gpu_ids = (), ()
        return gpus, gpu_ids

    def restart_count(self) -> int:
        for var in ("SLURM_JOB_RESTART_COUNT", "SLURM_RESTART_COUNT"):
            v = self.env.get(var)
            if v is not None:
                if v.isdigit() and len(v) < 6:
                    return int(v)
                self.ignored.append(var)
        return 0

    def exclusive(self) -> Optional[bool]:
        v = self.env.get("SLURM_JOB_EXCLUSIVE")
        if v is None:
            return None
        return v.strip() in ("1", "yes", "true", "exclusive", "user", "mcs")

    def job_exit_code(self) -> Optional[int]:
        """Epilog: SLURM_JOB_EXIT_CODE2's "exit:signal" as a shell would say it (128 + signal)."""
        v = self.env.get("SLURM_JOB_EXIT_CODE2") or self.env.get("SLURM_JOB_EXIT_CODE")
        if v is None:
            return None
        m = re.fullmatch(r"(\d{1,3})(?::(\d{1,3}))?", v.strip())
        if not m:
            self.ignored.append("SLURM_JOB_EXIT_CODE2")
            return None
        return int(m.group(2)) + 128 if m.group(2) and int(m.group(2)) else int(m.group(1))
