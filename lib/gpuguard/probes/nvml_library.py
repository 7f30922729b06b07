"""Which NVML library pynvml talks to (the real libnvidia-ml.so.1, or the fake one built from a scenario), and the
environment NVML reads while it initialises."""

from __future__ import annotations

import os
import sys
import threading
import types
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

_IMPORT_LOCK = threading.Lock()


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
        nv = import_pynvml()
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


def import_pynvml() -> types.ModuleType:
    """The pynvml module, imported without `ctypes.util`.

    pynvml (nvidia-ml-py) does `from ctypes.util import find_library` at import but never calls it: it loads
    libnvidia-ml.so.1 by name (or the library install_nvml_library names). ctypes.util imports shutil, tempfile,
    random, bz2 and lzma: ~11M instructions (~5 ms of CPU) on every prolog that runs in its own process. So while
    pynvml is imported, `ctypes.util` is a stand-in whose find_library imports the real module at its first call;
    the stand-in leaves sys.modules right after, so any later `import ctypes.util` gets the real one. Raises
    ImportError when the binding is not installed."""
    nv = sys.modules.get("pynvml")
    if nv is not None:
        return nv
    with _IMPORT_LOCK:
        if "ctypes.util" in sys.modules or "pynvml" in sys.modules:
            import pynvml
            return pynvml
        stand_in = types.ModuleType("ctypes.util", "gpuguard's stand-in while pynvml is imported (import_pynvml)")
        stand_in.find_library = _find_library  # type: ignore[attr-defined]
        sys.modules["ctypes.util"] = stand_in
        try:
            import pynvml
        finally:
            if sys.modules.get("ctypes.util") is stand_in:
                del sys.modules["ctypes.util"]
        return pynvml


def _find_library(name: str) -> str | None:
    import ctypes.util  # the real one (the stand-in is gone once pynvml is imported)

    return ctypes.util.find_library(name)


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
