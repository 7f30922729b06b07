"""IMDSv2 instance-type probe against a real HTTP server on 127.0.0.1 (no mocks of http.client)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest


from gpuguard.probes import imds  # noqa: E402
from gpuguard.probes.imds import get_instance_type  # noqa: E402
from gpuguard.probes.imds_cache import is_valid_instance_type, lookup, parse_cache  # noqa: E402

TOKEN = "AQAEAFakeTokenForTests=="


class FakeImds:
    """IMDSv2: PUT /latest/api/token (TTL header required) -> token; GET with the token -> metadata."""

    def __init__(self, instance_type: str = "p5.48xlarge", v1_only: bool = False) -> None:
        self.instance_type = instance_type
        self.v1_only = v1_only
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def _reply(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 - http.server API
                fake.requests.append(("PUT", self.path, dict(self.headers)))
                if fake.v1_only:
                    self._reply(405, "Method Not Allowed")
                elif self.path != imds.TOKEN_PATH:
                    self._reply(404, "Not Found")
                elif not self.headers.get(imds.TOKEN_TTL_HEADER):
                    self._reply(400, "Bad Request")
                else:
                    self._reply(200, TOKEN)

            def do_GET(self) -> None:  # noqa: N802
                fake.requests.append(("GET", self.path, dict(self.headers)))
                if self.headers.get(imds.TOKEN_HEADER) != TOKEN and not fake.v1_only:
                    self._reply(401, "Unauthorized")
                elif self.path == imds.INSTANCE_TYPE_PATH:
                    self._reply(200, fake.instance_type)
                else:
                    self._reply(404, "Not Found")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeImds":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_port_endpoint() -> str:
    """An endpoint nobody listens on: connection refused, like IMDS off EC2 on many networks."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """Accepts TCP connections (kernel backlog) but never answers: the black-hole case."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    p = tmp_path / "boot_id"
    p.write_text("0f6c2a9e-1111-4c1e-9d6e-aaaaaaaaaaaa\n")
    return p


def test_token_dance_returns_instance_type_and_caches_it(tmp_path: Path, boot_id: Path) -> None:
    cache = tmp_path / "state" / "imds.json"
    with FakeImds("p5.48xlarge") as srv:
        assert get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id)) == "p5.48xlarge"
    methods = [(m, p) for m, p, _ in srv.requests]
    assert methods == [("PUT", imds.TOKEN_PATH), ("GET", imds.INSTANCE_TYPE_PATH)]
    assert srv.requests[0][2].get(imds.TOKEN_TTL_HEADER)
    assert srv.requests[1][2].get(imds.TOKEN_HEADER) == TOKEN
    data = json.loads(cache.read_text())
    assert data["boot_id"] == boot_id.read_text().strip()
    assert data["instance_type"] == "p5.48xlarge"


def test_the_hooks_lookup_reads_this_boots_cache_only(tmp_path: Path, boot_id: Path) -> None:
    """What every hook asks before IMDS (gpuguard.pipeline.plan.instance_type): the cache of this boot; another
    boot's answer, a stale "not EC2" or no boot id is a miss, which then asks IMDS."""
    cache = tmp_path / "imds.json"
    assert lookup(str(cache), str(boot_id)) == (False, None)  # nothing cached yet
    with FakeImds("p5en.48xlarge") as srv:
        get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id))
    assert lookup(str(cache), str(boot_id)) == (True, "p5en.48xlarge")
    other = tmp_path / "other_boot"
    other.write_text("another-boot\n")
    assert lookup(str(cache), str(other)) == (False, None)
    assert lookup(str(cache), str(tmp_path / "no_boot_id")) == (False, None)
    get_instance_type(str(cache), endpoint=closed_port_endpoint(), boot_id_path=str(other))  # "not EC2" cached
    fetched = json.loads(cache.read_text())["fetched_at"]
    assert lookup(str(cache), str(other), now=fetched + 1) == (True, None)
    assert lookup(str(cache), str(other), now=fetched + 601) == (False, None)
    cache.write_bytes(b"\xff\xfe{not json")  # a damaged cache is a miss, never an exception on the hooks' path
    assert lookup(str(cache), str(other), now=fetched + 1) == (False, None)


def test_no_cache_path_still_works(boot_id: Path) -> None:
    with FakeImds("p6-b200.48xlarge") as srv:
        assert get_instance_type(None, endpoint=srv.endpoint, boot_id_path=str(boot_id)) == "p6-b200.48xlarge"


def test_cache_hit_needs_no_server(tmp_path: Path, boot_id: Path) -> None:
    cache = tmp_path / "imds.json"
    with FakeImds("p4d.24xlarge") as srv:
        assert get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id)) == "p4d.24xlarge"
    # server gone: the cached answer for this boot is used without any network call
    t0 = time.monotonic()
    got = get_instance_type(str(cache), endpoint=closed_port_endpoint(), boot_id_path=str(boot_id))
    assert got == "p4d.24xlarge"
    assert time.monotonic() - t0 < 0.5


def test_new_boot_id_invalidates_cache(tmp_path: Path, boot_id: Path) -> None:
    cache = tmp_path / "imds.json"
    with FakeImds("p4d.24xlarge") as srv:
        assert get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id)) == "p4d.24xlarge"
    boot_id.write_text("22222222-3333-4444-5555-666666666666\n")  # rebooted (stop/start may change the type)
    with FakeImds("p5en.48xlarge") as srv:
        assert get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id)) == "p5en.48xlarge"
        assert len(srv.requests) == 2  # it really asked again
    assert json.loads(cache.read_text())["instance_type"] == "p5en.48xlarge"


def test_new_boot_id_with_imds_down_returns_none_not_stale(tmp_path: Path, boot_id: Path) -> None:
    cache = tmp_path / "imds.json"
    with FakeImds("p4d.24xlarge") as srv:
        get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id))
    boot_id.write_text("99999999-0000-0000-0000-000000000000\n")
    assert get_instance_type(str(cache), endpoint=closed_port_endpoint(), boot_id_path=str(boot_id)) is None


def test_connection_refused_is_none_and_fast(tmp_path: Path, boot_id: Path) -> None:
    t0 = time.monotonic()
    assert get_instance_type(str(tmp_path / "c.json"), endpoint=closed_port_endpoint(), boot_id_path=str(boot_id)) is None
    assert time.monotonic() - t0 < 0.5


def test_server_that_never_answers_times_out(tmp_path: Path, boot_id: Path, silent_endpoint: str) -> None:
    t0 = time.monotonic()
    got = get_instance_type(str(tmp_path / "c.json"), timeout_s=0.5, endpoint=silent_endpoint, boot_id_path=str(boot_id))
    elapsed = time.monotonic() - t0
    assert got is None
    assert elapsed < 1.5, f"total timeout not honoured: {elapsed:.2f}s"


def test_default_total_timeout_is_one_second(silent_endpoint: str) -> None:
    t0 = time.monotonic()
    assert imds.fetch_instance_type(silent_endpoint) is None
    assert 0.8 < time.monotonic() - t0 < 2.0


def test_negative_answer_is_cached_for_a_while(tmp_path: Path, boot_id: Path, silent_endpoint: str) -> None:
    cache = tmp_path / "c.json"
    assert get_instance_type(str(cache), timeout_s=0.3, endpoint=silent_endpoint, boot_id_path=str(boot_id)) is None
    # an on-prem node must not pay the timeout on every job: the "not EC2" answer is reused ...
    with FakeImds("p5.48xlarge") as srv:
        assert get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id)) is None
        assert srv.requests == []
        # ... but only for negative_ttl_s, so a transient IMDS failure on EC2 does not stick all boot
        assert (
            get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id), negative_ttl_s=0)
            == "p5.48xlarge"
        )


def test_imdsv1_only_endpoint_is_not_trusted(tmp_path: Path, boot_id: Path) -> None:
    with FakeImds("p5.48xlarge", v1_only=True) as srv:
        assert get_instance_type(str(tmp_path / "c.json"), endpoint=srv.endpoint, boot_id_path=str(boot_id)) is None


def test_garbage_body_is_rejected(tmp_path: Path, boot_id: Path) -> None:
    # e.g. a captive portal or proxy answering for 169.254.169.254
    with FakeImds("<html><body>Welcome</body></html>") as srv:
        assert get_instance_type(str(tmp_path / "c.json"), endpoint=srv.endpoint, boot_id_path=str(boot_id)) is None


def test_corrupt_cache_is_a_miss_and_is_rewritten(tmp_path: Path, boot_id: Path) -> None:
    cache = tmp_path / "c.json"
    cache.write_text("{not json")
    with FakeImds("p4de.24xlarge") as srv:
        assert get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(boot_id)) == "p4de.24xlarge"
    assert json.loads(cache.read_text())["instance_type"] == "p4de.24xlarge"


def test_unreadable_boot_id_disables_cache(tmp_path: Path) -> None:
    cache = tmp_path / "c.json"
    with FakeImds("p5.48xlarge") as srv:
        got = get_instance_type(str(cache), endpoint=srv.endpoint, boot_id_path=str(tmp_path / "missing"))
    assert got == "p5.48xlarge"
    assert not cache.exists()


def test_unwritable_cache_dir_still_answers(tmp_path: Path, boot_id: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with FakeImds("p5.48xlarge") as srv:
        got = get_instance_type(str(blocker / "sub" / "c.json"), endpoint=srv.endpoint, boot_id_path=str(boot_id))
    assert got == "p5.48xlarge"


@pytest.mark.parametrize(
    "text,hit,value",
    [
        ('{"version": 1, "boot_id": "b", "instance_type": "p5.48xlarge", "fetched_at": 0}', True, "p5.48xlarge"),
        ('{"version": 1, "boot_id": "other", "instance_type": "p5.48xlarge", "fetched_at": 0}', False, None),
        ('{"version": 2, "boot_id": "b", "instance_type": "p5.48xlarge", "fetched_at": 0}', False, None),
        ('{"version": 1, "boot_id": "b", "instance_type": null, "fetched_at": 990}', True, None),
        ('{"version": 1, "boot_id": "b", "instance_type": null, "fetched_at": 100}', False, None),
        ('{"version": 1, "boot_id": "b", "instance_type": "rm -rf /", "fetched_at": 0}', False, None),
        ("[]", False, None),
    ],
)
def test_parse_cache(text: str, hit: bool, value: str | None) -> None:
    assert parse_cache(text, "b", now=1000.0, negative_ttl_s=600.0) == (hit, value)


@pytest.mark.parametrize(
    "value,ok",
    [("p5.48xlarge", True), ("p6-b200.48xlarge", True), ("u-p6e-gb200x72", False), ("P5.48XLARGE", False), ("", False)],
)
def test_is_valid_instance_type(value: str, ok: bool) -> None:
    assert is_valid_instance_type(value) is ok
