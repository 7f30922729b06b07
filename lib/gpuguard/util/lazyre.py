"""Regular expressions compiled when first used, not when their module is imported.

Python compiles a pattern in pure Python (re._parser, re._compiler): some 0.1-0.3 ms each. The hook path imports
modules holding ~50 patterns of which a quiet prolog uses a handful (the kernel-log formats are parsed only for a
line that holds an Xid, a drain reason only when Slurm is asked): compiled lazily, they cost nothing until then.

    _XID_RE = lazy(r"NVRM: Xid ...", re.S)   # then _XID_RE.match(...) as with re.compile
"""

from __future__ import annotations

import re
from typing import Any, cast


class _Lazy:
    __slots__ = ("_args", "_compiled")

    def __init__(self, pattern: str, flags: int) -> None:
        self._args = (pattern, flags)
        self._compiled: Any = None

    def __getattr__(self, name: str) -> Any:  # only for what the slots do not hold: the pattern's own attributes
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = re.compile(*self._args)
        return getattr(compiled, name)

    def __repr__(self) -> str:
        return f"lazy({self._args[0]!r})"


def lazy(pattern: str, flags: int = 0) -> "re.Pattern[str]":
    """`re.compile(pattern, flags)` on first use (an invalid pattern raises re.error then, as a test of the module
    that uses it shows)."""
    return cast("re.Pattern[str]", _Lazy(pattern, flags))
