"""NVML's answers, classified (DESIGN §6): the error table every per-GPU query goes through.

  NOT_SUPPORTED, FUNCTION_NOT_FOUND          -> the value is None, not an error (the query is listed in
                                                `gpu.unsupported`)
  GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND -> `GpuGone`: the GPU is not queried further (`gpu.fatal_error`)
  anything else                              -> `gpu.errors[<query>] = <NVML error name>`, carry on
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from gpuguard.model import GpuInfo

# nvmlReturn_t codes (nvml.h) the classification depends on.
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
FUNCTION_NOT_FOUND = 13
ARGUMENT_VERSION_MISMATCH = 25
SKIPPED = frozenset({NOT_SUPPORTED, FUNCTION_NOT_FOUND})
FATAL = frozenset({15, 16, 28})  # GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND
# A newer entry point missing from an older driver: try the next (older) one instead.
TRY_OLDER = frozenset({FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH})

_error_names: dict[int, str] = {}


class GpuGone(Exception):
    """NVML said the GPU is gone or needs a reset; stop querying it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def nvml_error_name(nv: Any, code: int) -> str:
    """NVML return code -> name without the NVML_ERROR_ prefix, e.g. 15 -> 'GPU_IS_LOST'."""
    if not _error_names:
        # Built from the binding itself so codes added by newer nvidia-ml-py releases get their names.
        for attr, value in vars(nv).items():
            if attr.startswith("NVML_ERROR_") and isinstance(value, int):
                _error_names.setdefault(value, attr[len("NVML_ERROR_"):])
    return _error_names.get(code, f"ERROR_{code}")


class GpuQueries:
    """Runs NVML calls for one GPU and applies the error table to each."""

    def __init__(self, nv: Any, info: GpuInfo) -> None:
        self.nv = nv
        self.info = info

    def classify(self, query: str, code: int) -> None:
        """Record a failed query (or raise GpuGone); skipped codes leave no trace."""
        if code in SKIPPED:
            if query not in self.info.unsupported:
                self.info.unsupported.append(query)
            return
        name = nvml_error_name(self.nv, code)
        if code in FATAL:
            raise GpuGone(name)
        self.info.errors[query] = name

    def __call__(self, query: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            self.classify(query, exc.value)
            return None

    def first(self, query: str, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> Any:
        """Call the first pynvml wrapper that the binding and the driver both have (newest first)."""
        code = FUNCTION_NOT_FOUND
        for name, args in calls:
            fn = getattr(self.nv, name, None)
            if fn is None:
                continue
            try:
                return fn(*args)
            except self.nv.NVMLError as exc:
                code = exc.value
                if code not in TRY_OLDER:
                    break
        self.classify(query, code)
        return None
