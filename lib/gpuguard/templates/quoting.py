"""Shell quoting for rendered sbatch scripts.

Every value a template renders goes through `finalize` (installed as Jinja's `finalize` hook), so a template
cannot forget to quote: strings become one single-quoted shell word, lists become space-separated words, and
only `Markup` produced by our own macros (whose values were themselves quoted) passes through unchanged.

`#SBATCH` lines are read by sbatch, not the shell: sbatch honours shell-style quotes there (verified on
Slurm 22.05: `#SBATCH --job-name='my job $(x) "q"'` gives the job name `my job $(x) "q"`), but a newline would
end the comment and turn the rest into shell code. Values used in `#SBATCH` or comment lines are therefore
checked by `directive_safe` first: no control characters at all.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from jinja2 import Undefined
from markupsafe import Markup

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class QuotingError(ValueError):
    """A value that cannot be rendered safely (e.g. a mapping, or a newline in an #SBATCH value)."""


def shell_word(value: Any) -> str:
    """One shell word for a scalar: `shlex.quote` of its text (plain words stay readable: 8, node1, /a/b)."""
    if value is None:
        raise QuotingError("a null value cannot be rendered (leave the variable out, or give it a value)")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        if "\x00" in value:
            raise QuotingError("a NUL byte cannot be passed to a shell")
        if value.startswith("="):
            # `export X==a` is valid bash but reads like a typo (shellcheck SC1097): quote it
            return "'" + value + "'" if "'" not in value else shlex.quote(" " + value).replace("' ", "'", 1)
        return shlex.quote(value)
    raise QuotingError(f"cannot render a {type(value).__name__} as a shell word: {value!r}")


def finalize(value: Any) -> Markup:
    """Jinja `finalize` hook: everything `{{ ... }}` prints is shell-quoted unless it is our own Markup."""
    if isinstance(value, Markup):
        return value
    if isinstance(value, Undefined):
        str(value)  # StrictUndefined raises UndefinedError naming the variable
    if isinstance(value, (list, tuple)):
        return Markup(" ".join(shell_word(v) for v in value))
    return Markup(shell_word(value))


def directive_safe(value: Any, what: str) -> Any:
    """Reject control characters in a value bound for an `#SBATCH` or comment line."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, str) and _CONTROL.search(item):
            raise QuotingError(f"{what}: control characters (newline, tab, ...) are not allowed here: {item!r}")
    return value
