"""The optional tier's single-node collective test: nccl-tests `all_reduce_perf` on the node's GPUs (or, where
nccl-tests is not installed and the site allows it, the torch.distributed fallback probe), parsed into an
`NcclObservation` the `nccl.busbw` check judges.

A missing binary is `tool_missing` (incomplete), never a hardware failure; a run that ends without a table
(crash, NCCL error) is incomplete with the tool's own error line as evidence.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from gpuguard.model import ProbeStatus
from gpuguard.util.toolrun import run_tool, which
from gpuguard.nccl.parse import parse_nccl
from gpuguard.nccl.result import NcclResult



@dataclass
class NcclObservation:
    status: ProbeStatus = field(default_factory=ProbeStatus)
    backend: str = "nccl-tests"  # nccl-tests | torch
    binary: Optional[str] = None
    argv: list[str] = field(default_factory=list)
    gpus: int = 0
    ran: bool = False
    tool_missing: bool = False
    exit_code: Optional[int] = None
    result: Optional[NcclResult] = None
    error: Optional[str] = None  # the tool's last error line when it produced no usable table
    output_tail: str = ""

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "ran": self.ran, "tool_missing": self.tool_missing,
                               "exit_code": self.exit_code, "error": self.error}
        if self.result is not None:
            out.update(self.result.summary())
        return out


def nccl_tests_argv(binary: str, gpus: int, min_bytes: int, max_bytes: int, iterations: int = 20,
                    warmup: int = 5, factor: int = 2) -> list[str]:
    """One process driving all `gpus` GPUs of the node (`-g`), data check on (`-c 1`)."""
    return [binary, "-b", str(int(min_bytes)), "-e", str(int(max_bytes)), "-f", str(int(factor)), "-g",
            str(int(gpus)), "-n", str(int(iterations)), "-w", str(int(warmup)), "-c", "1"]


def _resolve(binary: str) -> Optional[str]:
    if os.sep in binary:
        return binary if os.path.isfile(binary) and os.access(binary, os.X_OK) else None
    # slurmd gives hooks no PATH: look in the usual places too
    return which(binary)


def observation_from_output(obs: NcclObservation, code: Optional[int], out: str, err: str) -> NcclObservation:
    obs.exit_code = code
    obs.ran = True
    obs.output_tail = (out[-2000:] + ("\n" + err[-1000:] if err.strip() else "")).strip()
    result = parse_nccl(out)
    obs.result = result
    if not result.rows:
        lines = [ln.strip() for ln in (err + "\n" + out).splitlines() if ln.strip()]
        errs = result.errors or [ln for ln in lines if "WARN" in ln or "rror" in ln or "failure" in ln]
        obs.error = (errs[-1] if errs else (lines[-1] if lines else f"exit code {code}, no output"))[:300]
        obs.status = ProbeStatus(complete=False, error=f"{obs.backend}: no result table ({obs.error})")
    elif code not in (0, None):
        obs.error = (result.errors[-1] if result.errors else f"exit code {code}")[:300]
    return obs


def run_single_node_nccl(binary: str = "all_reduce_perf", gpus: int = 8, timeout_s: float = 120.0,
                         min_bytes: int = 536870912, max_bytes: int = 4294967296, iterations: int = 20,
                         warmup: int = 5, fallback: Optional[str] = None,
                         env: Optional[Mapping[str, str]] = None) -> NcclObservation:
    """Run nccl-tests all_reduce_perf on this node's `gpus` GPUs and parse it. Never raises.

    `fallback="torch"`: when the binary is not installed, run the torch.distributed probe
    (`python -m gpuguard.nccl.torch_probe`, NCCL backend on GPUs) instead, in its own process.
    `env`: the environment for the tool (default: ours, which in a prolog carries CUDA_VISIBLE_DEVICES).
    """
    t0 = time.monotonic()
    exe = _resolve(binary)
    if exe is None:
        if fallback == "torch":
            obs = run_torch_probe(nprocs=gpus, timeout_s=timeout_s, min_bytes=min_bytes, max_bytes=max_bytes,
                                  iterations=iterations, warmup=warmup, backend="auto", env=env)
            return obs
        return NcclObservation(status=ProbeStatus(complete=False, error=f"{binary} not found (nccl-tests not installed)"),
                               binary=binary, gpus=gpus, tool_missing=True)
    argv = nccl_tests_argv(exe, gpus, min_bytes, max_bytes, iterations, warmup)
    obs = NcclObservation(binary=exe, argv=argv, gpus=gpus)
    run = run_tool(argv, timeout_s, env)
    code, out, err, timed_out = run.rc, run.text(), run.err_text(), run.timed_out
    if code is None and not timed_out:
        obs.status = ProbeStatus(complete=False, error=run.error)
        return obs
    if timed_out:
        obs.ran = True
        obs.output_tail = out[-2000:]
        obs.status = ProbeStatus(complete=False, error=f"nccl-tests timed out after {timeout_s:g}s", timed_out=True)
        obs.result = parse_nccl(out) if out else None
        return obs
    observation_from_output(obs, code, out, err)
    obs.status.duration_s = time.monotonic() - t0
    return obs


def run_torch_probe(nprocs: int = 2, timeout_s: float = 120.0, min_bytes: int = 1048576,
                    max_bytes: int = 67108864, iterations: int = 20, warmup: int = 5, backend: str = "auto",
                    python: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> NcclObservation:
    """The torch.distributed all_reduce probe in a child process (torch is never imported here). Never raises.
    torch not installed -> tool_missing."""
    t0 = time.monotonic()
    argv = [python or sys.executable, "-m", "gpuguard.nccl.torch_probe", "--nprocs", str(int(nprocs)),
            "--backend", backend, "--min-bytes", str(int(min_bytes)), "--max-bytes", str(int(max_bytes)),
            "--iters", str(int(iterations)), "--warmup", str(int(warmup))]
    obs = NcclObservation(backend="torch", binary=argv[0], argv=argv, gpus=nprocs)
    run = run_tool(argv, timeout_s, env)
    code, out, err, timed_out = run.rc, run.text(), run.err_text(), run.timed_out
    if code is None and not timed_out:
        obs.status = ProbeStatus(complete=False, error=run.error)
        return obs
    if timed_out:
        obs.ran = True
        obs.status = ProbeStatus(complete=False, error=f"torch probe timed out after {timeout_s:g}s", timed_out=True)
        return obs
    if code == 3 and "torch is not installed" in err:
        obs.tool_missing = True
        obs.status = ProbeStatus(complete=False, error="torch is not installed (no fallback probe)")
        return obs
    observation_from_output(obs, code, out, err)
    obs.status.duration_s = time.monotonic() - t0
    return obs
