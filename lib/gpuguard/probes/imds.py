"""EC2 instance type from the instance metadata service (IMDSv2), cached once per boot.

The prolog runs on every job, so it must not pay for a metadata round trip each time: the instance type cannot
change without a stop/start (which is a reboot), so the answer is cached in a small JSON file keyed by the
kernel's boot id. Off EC2 the endpoint refuses or never answers; that costs at most `timeout_s` and the
negative answer is cached for `negative_ttl_s` so an on-prem node does not pay it on every job either.

`http.client` is used directly: it is much lighter to import than urllib.request or requests. The cache itself is
gpuguard.probes.imds_cache: a hook reads it without importing this module (~20 ms of `http.client`) unless it
misses.
"""

from __future__ import annotations

import http.client
import socket
import time
from typing import Optional
from urllib.parse import urlsplit

from gpuguard.probes.imds_cache import (DEFAULT_BOOT_ID_PATH, MAX_BODY, NEGATIVE_TTL_S, cached_instance_type,
                                        is_valid_instance_type, read_boot_id, write_cache)

TOKEN_PATH = "/latest/api/token"
INSTANCE_TYPE_PATH = "/latest/meta-data/instance-type"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TOKEN_TTL_S = 300  # we use the token immediately; a short TTL is enough
DEFAULT_ENDPOINT = "http://169.254.169.254"

class _ImdsError(Exception):
    """The endpoint answered, but not like IMDSv2 (HTTP error, bad body)."""


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("IMDS deadline exceeded")
    return left


def _request(host: str, port: int, method: str, path: str, headers: dict[str, str], deadline: float) -> str:
    """One request on a fresh connection; every socket wait is bounded by what is left of `deadline`."""
    conn = http.client.HTTPConnection(host, port, timeout=_remaining(deadline))
    try:
        conn.connect()
        conn.sock.settimeout(_remaining(deadline))
        conn.request(method, path, headers=headers)
        # the response object reads from this same socket, so this bound also covers the body read
        conn.sock.settimeout(_remaining(deadline))
        resp = conn.getresponse()
        body = resp.read(MAX_BODY + 1)
        _remaining(deadline)  # a server that drips bytes must not stretch the total past the deadline
    finally:
        conn.close()
    if resp.status != 200:
        raise _ImdsError(f"{method} {path}: HTTP {resp.status}")
    if len(body) > MAX_BODY:
        raise _ImdsError(f"{method} {path}: response too large")
    try:
        return body.decode("ascii").strip()
    except UnicodeDecodeError:
        raise _ImdsError(f"{method} {path}: non-ASCII response") from None


def fetch_instance_type(endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 1.0) -> Optional[str]:
    """IMDSv2 token dance, then the instance type. None off EC2, on timeout, or on any unexpected answer."""
    deadline = time.monotonic() + timeout_s
    parts = urlsplit(endpoint)
    if parts.scheme != "http" or not parts.hostname:
        return None
    host, port = parts.hostname, parts.port or 80
    try:
        token = _request(host, port, "PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(TOKEN_TTL_S)}, deadline)
        if not token:
            return None
        itype = _request(host, port, "GET", INSTANCE_TYPE_PATH, {TOKEN_HEADER: token}, deadline)
    except (OSError, http.client.HTTPException, _ImdsError):
        # OSError covers connection refused, network unreachable and socket.timeout
        return None
    return itype if is_valid_instance_type(itype) else None


def get_instance_type(
    cache_path: str | None,
    timeout_s: float = 1.0,
    endpoint: str = DEFAULT_ENDPOINT,
    boot_id_path: str = DEFAULT_BOOT_ID_PATH,
    negative_ttl_s: float = NEGATIVE_TTL_S,
) -> str | None:
    """This EC2 instance's type ("p5.48xlarge"), or None off EC2. Never raises.

    With `cache_path`, the answer is reused for the rest of this boot (keyed by the kernel boot id); a "not EC2"
    answer is reused for `negative_ttl_s` only. Without a readable boot id nothing is cached: a cache that
    cannot be tied to a boot could outlive an instance-type change.
    """
    try:
        boot_id = read_boot_id(boot_id_path) if cache_path else None
        now = time.time()
        if cache_path and boot_id:
            hit, cached = cached_instance_type(cache_path, boot_id, now, negative_ttl_s)
            if hit:
                return cached
        itype = fetch_instance_type(endpoint, timeout_s)
        if cache_path and boot_id:
            write_cache(cache_path, boot_id, itype, now)
        return itype
    except Exception:  # noqa: BLE001 - a probe must never take the prolog down
        return None
