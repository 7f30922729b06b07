"""The per-boot cache of the EC2 instance type (gpuguard.probes.imds asks IMDSv2 when it misses).

The prolog runs on every job, so it reads only this small JSON file keyed by the kernel's boot id: the instance
type cannot change without a stop/start (which is a reboot). A "not EC2" answer is believed for `negative_ttl_s`
only. Pure parsing and a small file read: nothing of HTTP is imported here.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional, Tuple

from gpuguard.util.fs import atomic_write
from gpuguard.util.lazyre import lazy

DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
CACHE_VERSION = 1
MAX_BODY = 4096  # a token is ~56 bytes, an instance type < 32; anything bigger is not IMDS
NEGATIVE_TTL_S = 600.0  # how long "not EC2" is believed

# "p5.48xlarge", "p6-b200.48xlarge", "u-6tb1.metal": lower-case family, a dot, a size.
_INSTANCE_TYPE_RE = lazy(r"^[a-z0-9][a-z0-9-]*\.[a-z0-9-]+$")


def is_valid_instance_type(value: str) -> bool:
    return bool(value) and len(value) <= 64 and bool(_INSTANCE_TYPE_RE.match(value))


def read_boot_id(boot_id_path: str = DEFAULT_BOOT_ID_PATH) -> Optional[str]:
    try:
        with open(boot_id_path, encoding="ascii", errors="replace") as f:
            boot_id = f.read().strip()
    except OSError:
        return None
    return boot_id or None


def parse_cache(text: str, boot_id: str, now: float, negative_ttl_s: float) -> Tuple[bool, Optional[str]]:
    """(hit, instance_type) from the cache file's text. Pure: a stale, foreign or corrupt cache is a miss."""
    try:
        data = json.loads(text)
    except ValueError:
        return False, None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("boot_id") != boot_id:
        return False, None
    itype = data.get("instance_type")
    if itype is None:
        # "not EC2" is only believed for a while: a transient IMDS failure on EC2 must not stick all boot.
        fetched_at = data.get("fetched_at")
        if isinstance(fetched_at, (int, float)) and 0 <= now - fetched_at < negative_ttl_s:
            return True, None
        return False, None
    if isinstance(itype, str) and is_valid_instance_type(itype):
        return True, itype
    return False, None


def cached_instance_type(cache_path: str, boot_id: str, now: float,
                         negative_ttl_s: float) -> Tuple[bool, Optional[str]]:
    """(hit, instance_type) from the cache file of this boot; a missing, unreadable or undecodable file is a miss."""
    try:
        with open(cache_path, encoding="utf-8") as f:
            text = f.read(MAX_BODY)
    except (OSError, UnicodeDecodeError):
        return False, None
    return parse_cache(text, boot_id, now, negative_ttl_s)


def write_cache(cache_path: str, boot_id: str, instance_type: Optional[str], now: float) -> None:
    """Atomic replace, so a concurrent prolog and health check never read half a file. Best effort."""
    payload: dict[str, Any] = {
        "version": CACHE_VERSION,
        "boot_id": boot_id,
        "instance_type": instance_type,
        "fetched_at": now,
    }
    try:
        atomic_write(cache_path, json.dumps(payload))
    except OSError:
        pass  # a read-only or missing state dir only costs the next run one more IMDS call


def lookup(cache_path: str, boot_id_path: str = DEFAULT_BOOT_ID_PATH, negative_ttl_s: float = NEGATIVE_TTL_S,
           now: Optional[float] = None) -> Tuple[bool, Optional[str]]:
    """(hit, instance_type) for this boot, from the cache alone: what a hook asks before it would ask IMDS. Without
    a readable boot id it is a miss (gpuguard.probes.imds.get_instance_type then caches nothing either)."""
    boot_id = read_boot_id(boot_id_path)
    if not boot_id:
        return False, None
    return cached_instance_type(cache_path, boot_id, time.time() if now is None else now, negative_ttl_s)
