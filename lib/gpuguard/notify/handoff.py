"""A hook's notifications are delivered by a process of their own, after the hook.

A hook's process exits as soon as the hook is done (slurmd waits for it); a delivery thread in it would die with
it, possibly in the middle of a request the receiver had already taken, which the next flush would then send
again (a drain paged twice, its Alertmanager alert posted two to four times). So a hook only spools what it has to
tell (`emit(..., defer=handoff)`, `flush(..., defer=handoff)`: gpuguard.pipeline.tell) and `hand_off`, as the hook
ends, starts `python -I -m gpuguard.notify.handoff` in a session of its own (slurmd does not wait for it, and no
kill of the hook's process group reaches it). It flushes that node's spool within `BUDGET_S` and exits. Every row
it sends is claimed first (gpuguard.notify.claim): a hand-off of another hook, the health check's and the watch
daemon's never send the same message, and each message leaves once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Optional, Sequence

from gpuguard.siteconfig import load_guarded
from gpuguard.notify.api import flush
from gpuguard.util.log import HookLog

BUDGET_S = 30.0  # the flush's own budget; the process ends a few seconds after it whatever hangs


def hand_off(config_path: Optional[str], node: str) -> bool:
    """Start the delivery process for what a hook run spooled (its RunResult.handoff / Handoff said so). Never
    raises."""
    argv = [sys.executable, "-I", "-m", "gpuguard.notify.handoff", "--node", node]
    if config_path:
        argv += ["--config", config_path]
    try:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
    except OSError:
        return False  # the spool still has them: the next flush delivers them
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`--node NODE [--config FILE]`: flush NODE's hooks' spool once, within BUDGET_S."""
    args = list(sys.argv[1:] if argv is None else argv)
    opts = dict(zip(args[::2], args[1::2]))
    node = opts.get("--node")
    if not node or set(opts) - {"--node", "--config"} or len(args) % 2:
        print("usage: python -m gpuguard.notify.handoff --node NODE [--config FILE]", file=sys.stderr)
        return 2
    timer = threading.Timer(BUDGET_S + 5.0, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
    cfg = load_guarded(opts.get("--config"))
    sent = flush(cfg, budget_s=BUDGET_S, node=node)
    log = HookLog(cfg.logging.syslog, cfg.logging.file, cfg.logging.level, stderr=False)
    log.info(f"notify on {node}: delivered {sent} message(s) a hook had spooled")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # never wait for a delivery thread stuck on a receiver
