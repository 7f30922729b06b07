"""The `nccl:` section: the optional prolog tier, fleet sweeps and baselines (docs/nccl.md)."""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.config.fields import Section, boolean, choice, integer, key, mapping, number, section, string


@section
class NcclConfig(Section):
    """`nccl:` NCCL/EFA/DCGM validation."""

    # optional prolog tier (single-node all_reduce + dcgmi diag + EFA counter deltas); see docs/nccl.md
    tier_enabled: bool = key(boolean, False)
    only_exclusive: bool = key(boolean, True)  # only jobs given every GPU of the node (22.05: no SLURM_JOB_EXCLUSIVE)
    first_job_after_reboot: bool = key(boolean, True)  # once per boot (false: every exclusive job)
    tier_interval_h: float = key(number(0, strict=False), 0.0)  # ... and again after this many hours (0 = never)
    binary: str = key(string(), "all_reduce_perf")  # nccl-tests all_reduce_perf (path or name on PATH)
    fallback: str = key(choice("none", "torch"), "none")  # nccl-tests missing: torch.distributed probe instead
    min_bytes: int = key(integer(4), 536870912)
    max_bytes: int = key(integer(4), 4294967296)
    iterations: int = key(integer(1), 20)
    timeout_s: float = key(number(), 120.0)
    dcgmi: Optional[str] = key(string(allow_none=True), "dcgmi")  # null = no DCGM diagnostics in the tier
    dcgm_level: int = key(integer(1), 1)  # dcgmi diag -r N (1 quick, 2 medium, 3/4 long)
    dcgm_timeout_s: float = key(number(), 300.0)
    # fleet sweep (gpuguard nccl sweep); thresholds per node count win over the single figure
    sweep_busbw_gbps: Optional[float] = key(number(allow_none=True), None)
    sweep_busbw_by_nodes: dict[Any, Any] = key(mapping, {})  # {2: 380, 16: 350}: node count -> GB/s
    sweep_method: str = key(choice("pairwise", "bisect"), "pairwise")
    sweep_gpus_per_node: int = key(integer(1), 8)
    sweep_min_bytes: int = key(integer(4), 1073741824)
    sweep_max_bytes: int = key(integer(4), 17179869184)
    sweep_iterations: int = key(integer(1), 20)
    sweep_time_limit: str = key(string(), "00:15:00")
    sweep_job_timeout_s: float = key(number(), 1800.0)
    sweep_binary: Optional[str] = key(string(allow_none=True), None)  # path on the compute nodes (default: binary)
    # NCCL environment preset of the nccl-tests template
    sweep_preset: Optional[str] = key(string(allow_none=True), None)
    sweep_mpi: str = key(choice("pmix", "pmi2", "none"), "pmix")  # srun --mpi for the (MPI=1) nccl-tests build
    sweep_drain: bool = key(boolean, True)
    sweep_max_drain_fraction: float = key(number(), 0.5)  # more slow nodes than this: fabric problem, drain nothing
    # scripts + outputs, shared FS (default: by the store)
    sweep_workdir: Optional[str] = key(string(allow_none=True), None)
    # sweep/baseline store (default: store.path, {node}=fleet)
    history_path: Optional[str] = key(string(allow_none=True), None)
    # baselines (gpuguard baseline): threshold = median - max(k * 1.4826 * MAD, margin_pct% of median)
    baseline_min_samples: int = key(integer(1), 5)
    baseline_k: float = key(number(), 3.0)
    baseline_margin_pct: float = key(number(0, strict=False), 5.0)
    # job pre-flight (gpuguard preflight, docs/nccl.md): floor of the largest size's busbw (by node count wins;
    # neither: the baseline proposal; none at all: only a hang or failure is judged)
    preflight_budget_s: float = key(number(), 20.0)  # the whole pre-flight, blame included
    preflight_busbw_gbps: Optional[float] = key(number(allow_none=True), None)
    preflight_busbw_by_nodes: dict[Any, Any] = key(mapping, {})  # {2: 380, 16: 350}: node count -> GB/s
    # auto: torch.distributed over NCCL on GPUs, gloo on CPU; nccl-tests: the sweep's all_reduce_perf, an srun step
    preflight_backend: str = key(choice("auto", "nccl", "gloo", "nccl-tests"), "auto")
    preflight_min_bytes: int = key(integer(4), 65536)
    preflight_max_bytes: int = key(integer(4), 4194304)
    preflight_iterations: int = key(integer(1), 3)
    preflight_drain: bool = key(boolean, True)  # drain the node blamed (else: only exclude it from the job)
