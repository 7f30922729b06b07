"""The watch daemon as a real process for integration tests: started like systemd starts it (Type=notify), its
simulated node's kernel log appended to as the driver would, stopped at the end of the test."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Watch:
    """The daemon for one node, started like systemd would (Type=notify: it says READY=1 on $NOTIFY_SOCKET)."""

    def __init__(self, site: Any, node: str, tmp: Path) -> None:
        self.site, self.node = site, node
        self.sock_path = str(tmp / f"notify-{node}-{time.monotonic_ns()}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.sock.settimeout(20)
        env = {**site.cluster.env, "NOTIFY_SOCKET": self.sock_path}
        self.proc = subprocess.Popen(
            [site.python, "-m", "gpuguard", "watch", "--config", str(site.config_path), "--node", node],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            msg = self.sock.recv(4096)
        except socket.timeout:
            self.stop()
            raise AssertionError(f"watch did not get ready: {self.proc.stderr.read() if self.proc.stderr else ''}")
        assert msg.startswith(b"READY=1"), msg

    @property
    def kmsg(self) -> Path:
        return self.site.workdir / "sim" / self.node / "kmsg"

    def append_kernel(self, *texts: str) -> float:
        """Append kernel records (facility 0) after the last one; returns when they were written."""
        last = 0
        for line in self.kmsg.read_text().splitlines():
            m = re.match(r"\d+,(\d+),", line)
            if m:
                last = int(m.group(1))
        records = "".join(f"4,{last + i},{1_000_000 * (200 + last + i)},-;{t}\n" for i, t in enumerate(texts, 1))
        with open(self.kmsg, "a") as f:
            f.write(records)
        return time.monotonic()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()
        return self.proc.returncode
