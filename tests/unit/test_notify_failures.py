"""Failed deliveries an operator must see (issue 29, item 9): `gpuguard status` names every receiver that did not
take a message (an HA pair of Alertmanagers both down: both named, whatever one of them answered), and every failed
attempt reaches the log file (`logging.file`) once per message and receiver, at warning level, the receiver's
secrets redacted. Real HTTP servers: one answering 503 with a proxy's long error page, one port nobody listens on,
a webhook whose URL carries a token."""

from __future__ import annotations

import http.server
import threading
from dataclasses import replace

import pytest
import yaml
from alertmanager_server import free_port

from gpuguard.notify.backlog import undelivered_notifications
from gpuguard.cli.status_render import render_status
from gpuguard.siteconfig import parse_config
from gpuguard.notify import Event, emit, flush

NOW = 1795550793.0


class ProxyPage:
    """An Alertmanager behind a proxy that answers every POST with 503 and a long HTML page."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = b"<html><body>" + b"upstream connect error or disconnect/reset before headers " * 20 + b"</html>"
                self.send_response(503)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/monitoring/alertmanager-a/"

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def proxy():
    p = ProxyPage()
    yield p
    p.close()


def _cfg(tmp_path, ams, urls=(), level="info"):
    data = {"store": {"path": str(tmp_path / "state" / "{node}.db")},
            "logging": {"syslog": False, "file": str(tmp_path / "gpuguard.log"), "level": level},
            "notify": {"alertmanager_urls": list(ams), "urls": list(urls), "cluster": "c1", "timeout_s": 2}}
    cfg = parse_config(yaml.safe_dump(data), source="test")
    cfg.node = replace(cfg.node, name="node7")
    return cfg


def _drain():
    return Event(kind="drain", node="node7", severity="critical", check_id="gpu.xid", reason="gpuguard: XID79 x",
                 message="GPU has fallen off the bus on 0000:86:00", ts=NOW)


def test_status_names_every_alertmanager_that_did_not_take_the_alert(tmp_path, proxy):
    dead = f"http://127.0.0.1:{free_port()}/monitoring/alertmanager-b/"
    cfg = _cfg(tmp_path, [proxy.url, dead])
    assert emit(cfg, _drain(), budget_s=5, now=NOW) == "spooled"
    spool = undelivered_notifications(str(tmp_path / "state" / "{node}.db"))
    text = render_status([], spool, NOW + 60, show_foreign=False)
    assert proxy.url in text and "HTTP 503" in text, text
    assert dead in text and "Connection refused" in text, text


def test_every_failed_delivery_attempt_reaches_the_log_file_once_redacted(tmp_path, proxy):
    dead = f"http://127.0.0.1:{free_port()}/monitoring/alertmanager-b/"
    webhook = f"json://127.0.0.1:{free_port()}/hooks/T0KEN-s3cr3t-value"
    cfg = _cfg(tmp_path, [proxy.url, dead], urls=[webhook])
    assert emit(cfg, _drain(), budget_s=8, now=NOW) == "spooled"
    log = (tmp_path / "gpuguard.log").read_text()
    failed = [line for line in log.splitlines() if "delivery failed" in line]
    assert len(failed) == 3, log  # one per receiver
    assert all(" warning: " in line and "DRAINED node7" in line for line in failed), failed
    assert sum(proxy.url in line and "HTTP 503" in line for line in failed) == 1, failed
    assert sum(dead in line for line in failed) == 1, failed
    assert "s3cr3t" not in log and "T0KEN" not in log, log
    assert flush(cfg, now=NOW + 60, budget_s=8) == 0  # the retry fails again: logged again, once per receiver
    again = [line for line in (tmp_path / "gpuguard.log").read_text().splitlines() if "delivery failed" in line]
    assert len(again) == 6 and "attempt 2" in again[-1], again


def test_a_log_level_of_error_keeps_the_failures_out_of_the_file(tmp_path):
    cfg = _cfg(tmp_path, [f"http://127.0.0.1:{free_port()}/"], level="error")
    assert emit(cfg, _drain(), budget_s=5, now=NOW) == "spooled"
    path = tmp_path / "gpuguard.log"
    assert not path.exists() or "delivery failed" not in path.read_text()
