"""A store found damaged and replaced is loud (issue 27). gpuguard.store.sqlite moves a corrupt file aside and starts
a new one; what the old one remembered (FLAPPING counts, notification episodes, throttles and spool, the inventory
high-water mark, job cursors, the metrics' counters) is gone. So the replacement is:

- logged at once, at error level, to syslog by whichever process replaced it (a hook, the watch daemon, the
  notification hand-off, an admin command), naming the file and where the damaged copy went;
- noted in the new store (the `store_replaced` cursor): the node's metrics show `gpuguard_history_store_ok` 0 from
  the first file written after it until a later good run (`metric_ok`); the hooks log it in their own log and page
  it once (gpuguard.cli.hooks: at once when the hook's own process replaced the store, else at the next health
  check), then mark it told.

`note`, `describe` and `metric_ok` are pure; `log_replaced` writes syslog.
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.util.log import escape_text
from gpuguard.util.timefmt import iso_utc

CURSOR = "store_replaced"
FORGOTTEN = ("FLAPPING counts, notification episodes, throttles and spool, the inventory high-water mark, job "
             "cursors and the metrics' counters restart")

_HERE: list[str] = []  # the stores this process replaced


def note(aside: str, error: Optional[str], now: float) -> dict[str, Any]:
    """What the new store keeps about the replacement. Pure."""
    return {"aside": aside, "error": error, "at": now, "told": False, "shown": None, "cleared": None}


def describe(path: str, n: dict[str, Any]) -> str:
    """One log line / page text for the note `n` of the store at `path`. Pure."""
    when = iso_utc(n.get("at")) or "?"
    return (f"history store {path} was damaged ({n.get('error') or 'integrity check failed'}) and replaced by a new "
            f"one at {when}; the damaged copy is {n.get('aside')}. {FORGOTTEN}")


def metric_ok(n: Optional[dict[str, Any]], run_started: float,
              run_ok: bool) -> tuple[bool, Optional[dict[str, Any]]]:
    """(whether gpuguard_history_store_ok may read 1 for the run that started at `run_started`, the note to store
    when it changes). The first metrics written after a replacement read 0; a later run with a usable store clears
    it. Pure."""
    if not n or n.get("cleared") is not None:
        return True, None
    shown = n.get("shown")
    if shown is None:
        return False, {**n, "shown": run_started}
    if run_ok and run_started > float(shown):
        return True, {**n, "cleared": run_started}
    return False, None


def log_replaced(path: str, n: dict[str, Any]) -> None:
    """The replacement in syslog, at error level, at once (whoever replaced the store). Never raises."""
    _HERE.append(path)
    try:
        import syslog  # only when a store was replaced

        syslog.syslog(syslog.LOG_ERR, escape_text(f"gpuguard: {describe(path, n)}"))
    except Exception:  # noqa: BLE001 - the note in the new store still makes it loud
        pass


def replaced_here() -> list[str]:
    """The paths of the stores this process replaced (the hooks page those at once)."""
    return list(dict.fromkeys(_HERE))


def untold(store: Any) -> Optional[dict[str, Any]]:
    """The store's replacement note when nobody has paged it yet."""
    n = store.get_cursor(CURSOR)
    return n if n and not n.get("told") else None


def mark_told(store: Any, n: dict[str, Any]) -> None:
    store.set_cursor(CURSOR, {**n, "told": True})
