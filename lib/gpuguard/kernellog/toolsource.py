"""What the sources read through a tool's output (`dmesg`, `journalctl`) share: where the tool is, which boot they
belong to, and the tool kept running while following (gpuguard.kernellog.proc.ToolFollower, restarted with back-off
when it exits). Each source says how to call its tool, how to read its output and what its cursor is."""

from __future__ import annotations

from typing import Callable, Optional

from gpuguard.kernellog.base import DEFAULT_BOOT_ID_PATH, KernelLogSource, read_boot_id
from gpuguard.kernellog.proc import ToolFollower
from gpuguard.kernellog.scan import DEFAULT_MAX_EVENTS


class ToolSource(KernelLogSource):
    def __init__(self, spec: str, *, boot_id: Optional[str] = None, boot_id_path: str = DEFAULT_BOOT_ID_PATH,
                 max_events: int = DEFAULT_MAX_EVENTS, restart_initial_s: float = 1.0,
                 restart_max_s: float = 30.0) -> None:
        super().__init__()
        self.spec = spec
        self.boot_id = boot_id if boot_id is not None else read_boot_id(boot_id_path)
        self.max_events = max_events
        self.restart_initial_s = restart_initial_s
        self.restart_max_s = restart_max_s
        self._follower: Optional[ToolFollower] = None

    def _start_following(self, argv: Callable[[], list[str]], once: bool) -> None:
        """Run the tool (`argv()` is asked again at each restart) until close(); with `once`, until it exits."""
        self._follower = ToolFollower(argv, self.stats, self.notes, keep_running=not once, on_exit=self._exited,
                                      restart_initial_s=self.restart_initial_s, restart_max_s=self.restart_max_s)

    def _exited(self, rc: int, printed: bool) -> None:
        """The followed tool exited with `rc` (`printed`: after printing something); it is started again."""

    def _new_output(self) -> Optional[bytes]:
        """The complete lines the followed tool printed since the last call (None: nothing)."""
        assert self._follower is not None, "follow() first"
        data = self._follower.read_lines()
        self.finished = self._follower.finished
        return data

    def wait_fd(self) -> Optional[int]:
        return self._follower.wait_fd() if self._follower is not None else None

    def close(self) -> None:
        if self._follower is not None:
            self._follower.close()
