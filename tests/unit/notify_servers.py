"""Real local servers the notification tests deliver to: an HTTP server (generic JSON webhooks and Slack-style
`{"text": ...}` webhooks) and a small SMTP server on asyncio. Both listen on 127.0.0.1 on a free port. The unit and
integration conftests serve them as the `hook` and `smtp` fixtures; some tests start more."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from email import message_from_string
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional


def _wait_for(received: list[dict[str, Any]], n: int, timeout: float) -> list[dict[str, Any]]:
    """`received` once it holds `n` items, or after `timeout` seconds (the caller asserts what arrived)."""
    end = time.monotonic() + timeout
    while len(received) < n and time.monotonic() < end:
        time.sleep(0.02)
    return received


class WebhookServer:
    """Records every POST: (path, content type, parsed JSON or raw text). `status` / `delay_s` simulate trouble;
    `hold()` makes every answer wait until `release()` (a receiver slower than whatever runs meanwhile, however
    slowly the machine runs it); `arrived` counts the requests read, answered or not."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host  # 0.0.0.0 for nodes in network namespaces of their own (they dial the bridge's address)
        self.requests: list[dict[str, Any]] = []
        self.status = 200
        self.delay_s = 0.0
        self.arrived = 0
        self.gate: Optional[threading.Event] = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n).decode("utf-8", "replace")
                outer.arrived += 1
                gate = outer.gate
                if gate is not None:
                    gate.wait(timeout=300)
                if outer.delay_s:
                    time.sleep(outer.delay_s)
                try:
                    body: Any = json.loads(raw)
                except ValueError:
                    body = raw
                if outer.status == 200:
                    outer.requests.append({"path": self.path, "type": self.headers.get("Content-Type"),
                                           "body": body})
                self.send_response(outer.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path: str = "/hook", addr: str = "127.0.0.1") -> str:
        return f"json://{addr}:{self.port}{path}"

    def slack_style_url(self, token: str = "gpuguardtesttoken0123456789") -> str:
        # apprise's Mattermost plugin posts Slack's incoming-webhook JSON ({"text": ...}) to /hooks/<token>
        return f"mmost://127.0.0.1:{self.port}/{token}"

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        return _wait_for(self.requests, n, timeout)

    def hold(self) -> None:
        """From now on every request waits, unanswered and unrecorded, until `release()`."""
        self.gate = threading.Event()

    def release(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.gate = None

    def close(self) -> None:
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()


class SmtpServer:
    """Just enough ESMTP (EHLO/HELO, MAIL, RCPT, DATA, RSET, NOOP, QUIT) to receive what a client sends."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.port: Optional[int] = None
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._session, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(5)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 127.0.0.1 gpuguard-test ESMTP\r\n")
        sender, rcpts = None, []
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = line.decode("utf-8", "replace").strip()
            verb = cmd.split(" ", 1)[0].upper().split(":", 1)[0]
            if verb == "EHLO":
                writer.write(b"250-127.0.0.1\r\n250-8BITMIME\r\n250 SIZE 10485760\r\n")
            elif verb == "HELO":
                writer.write(b"250 127.0.0.1\r\n")
            elif verb == "MAIL":
                sender, rcpts = cmd.split(":", 1)[1].strip(), []
                writer.write(b"250 OK\r\n")
            elif verb == "RCPT":
                rcpts.append(cmd.split(":", 1)[1].strip())
                writer.write(b"250 OK\r\n")
            elif verb == "DATA":
                writer.write(b"354 end with <CRLF>.<CRLF>\r\n")
                await writer.drain()
                data = []
                while True:
                    chunk = await reader.readline()
                    if chunk in (b".\r\n", b".\n", b""):
                        break
                    data.append(chunk[1:] if chunk.startswith(b"..") else chunk)  # dot-unstuffing
                self.messages.append({"from": sender, "to": rcpts,
                                      "raw": b"".join(data).decode("utf-8", "replace")})
                writer.write(b"250 queued\r\n")
            elif verb == "QUIT":
                writer.write(b"221 bye\r\n")
                await writer.drain()
                break
            else:
                writer.write(b"250 OK\r\n")
            await writer.drain()
        writer.close()

    def url(self, to: str = "oncall@example.com") -> str:
        return f"mailto://127.0.0.1:{self.port}?from=gpuguard@example.com&to={to}&mode=insecure"

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        return _wait_for(self.messages, n, timeout)

    @staticmethod
    def text(msg: dict[str, Any]) -> tuple[Message, str]:
        """(parsed headers, the text/plain body decoded)."""
        m = message_from_string(msg["raw"])
        for part in m.walk():
            if part.get_content_type() == "text/plain":
                return m, part.get_payload(decode=True).decode("utf-8", "replace")
        return m, ""

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
