"""A real Alertmanager (Debian's prometheus-alertmanager, installed by `make deps`) for the tests: started in a
temp dir on a free local port, gossip off, with observability/alertmanager.yml's routing, grouping and
inhibition and its receivers pointed at a real local webhook server; short group_wait/group_interval so that a
test takes seconds. (Helpers only; imported by test_notify_alertmanager.py and the integration tests.)"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "observability" / "alertmanager.yml"
BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
AMTOOL = shutil.which("amtool")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def routed_config(webhook_base: str, group_wait: str = "2s", group_interval: str = "1s") -> dict[str, Any]:
    """The example configuration, its receivers posting to `webhook_base` + /page, /ticket, /log."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["route"].update(group_wait=group_wait, group_interval=group_interval, repeat_interval="1h")
    for r in cfg["receivers"]:
        for w in r.get("webhook_configs", []):
            w["url"] = webhook_base + "/" + w["url"].rsplit("/", 1)[1]
    return cfg


class Alertmanager:
    def __init__(self, workdir: Path, config: dict[str, Any], port: Optional[int] = None) -> None:
        assert BINARY, "prometheus-alertmanager missing: `make deps` installs Debian's prometheus-alertmanager"
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config_path = self.dir / "alertmanager.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.dir / "alertmanager.log"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(BINARY), f"--config.file={self.config_path}", f"--storage.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"alertmanager not ready after {timeout} s: {self.log_path.read_text()[-2000:]}")

    def alerts(self, **params: str) -> list[dict[str, Any]]:
        """GET /api/v2/alerts (active, silenced, inhibited, unprocessed by default; filter="node=\\"x\\"")."""
        query = "&".join(f"{k}={urllib.request.quote(v)}" for k, v in params.items())
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts?{query}", timeout=5) as r:
            return list(json.load(r))

    def wait_alerts(self, n: int, timeout: float = 15.0, **params: str) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout
        got = self.alerts(**params)
        while len(got) < n and time.monotonic() < end:
            time.sleep(0.1)
            got = self.alerts(**params)
        return got

    def amtool(self, *args: str) -> str:
        assert AMTOOL, "amtool missing: `make deps` installs Debian's prometheus-alertmanager"
        p = subprocess.run([AMTOOL, f"--alertmanager.url={self.url}", *args], capture_output=True, text=True,
                           timeout=30)
        assert p.returncode == 0, p.stderr
        return p.stdout

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class HungServer:
    """Accepts connections on a local port and never answers: an Alertmanager that hangs."""

    def __init__(self, port: Optional[int] = None) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port or 0))
        self.sock.listen(64)  # the kernel completes the handshakes; nobody ever reads or answers
        self.port = int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()
