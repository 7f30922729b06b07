"""SHA-256 for the hooks' hot path: the interpreter's own implementation, without hashlib, whose import loads
OpenSSL's libcrypto (about 4 ms of every hook's start-up, measured with `python -X importtime`). Same digests."""

from __future__ import annotations

try:
    from _sha256 import sha256  # CPython <= 3.11
except ImportError:  # pragma: no cover - 3.12 merged it into _sha2; another interpreter: hashlib's
    try:
        from _sha2 import sha256  # type: ignore[no-redef]
    except ImportError:
        from hashlib import sha256  # type: ignore[no-redef]


def sha256_hex(data: bytes) -> str:
    return sha256(data).hexdigest()
