"""Which NVML library pynvml talks to (the real libnvidia-ml.so.1, or the fake one built from a scenario), and the
environment NVML reads while it initialises."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Mapping


class NvmlLibraryInUse(RuntimeError):
    """pynvml holds an open session on a different NVML library than the one asked for."""


def install_nvml_library(library_path: str, nv: Any = None) -> None:
    """Make pynvml use the NVML library at `library_path` (e.g. the fake) instead of its own search.

    pynvml keeps the loaded CDLL in the module global `nvmlLib` (guarded by `libLoadLock`) and caches
    function pointers by name, so swapping libraries also empties that cache. Refuses to swap while a
    pynvml session is open on another library. Raises OSError when the file cannot be loaded.
    """
    import ctypes  # here, not at module level: the prolog imports this module on its hot path

    if nv is None:
        import pynvml as nv
    path = os.path.abspath(library_path)
    with nv.libLoadLock:
        current = nv.nvmlLib
        if current is not None and getattr(current, "_name", None) == path:
            return
        if current is not None and getattr(nv, "_nvmlLib_refcount", 0) > 0:
            raise NvmlLibraryInUse(f"pynvml has an open session on {getattr(current, '_name', current)}")
        library = ctypes.CDLL(path)
        nv.nvmlLib = library
        cache = getattr(nv, "_nvmlGetFunctionPointer_cache", None)
        if isinstance(cache, dict):
            cache.clear()  # pointers into the previous library


@contextmanager
def nvml_environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set `env` for the duration of nvmlInit (which is when NVML reads it), then restore."""
    if not env:
        yield
        return
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
