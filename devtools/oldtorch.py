"""The oldest PyTorch the templates support, in a venv of its own outside the checkout (tests/integration/
test_torchrun_oldest.py runs its torchrun as a container image's). `make torch` builds it before the tests run
(`python -m devtools.oldtorch`), so `make test`'s pytest time holds no 2.6 GB download and 4.7 GB install; a test
run on a machine without it builds it on first use.

Python 3.11 wheels start at 2.0; 2.1 is the oldest tested end to end. PyPI has no CPU-only Linux build of it: the
CUDA build imports on a machine without a GPU but needs NVIDIA's library wheels (2.6 GB to download, 4.7 GB
installed; about 80 s + 100 s on CI's 2 cores), so the venv is built once per machine and reused."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

OLDEST_TORCH = "2.1.2"


def oldest_torch_root() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuguard"
    return cache / f"torch-{OLDEST_TORCH}"


def oldest_torch_venv(python: str = sys.executable) -> Path:
    """A venv holding only torch==OLDEST_TORCH, built on first use (under a lock: xdist workers, or `make torch` and
    a test run, may ask at once)."""
    root = oldest_torch_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"torch-{OLDEST_TORCH}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".ok").exists():
            return root
        subprocess.run([python, "-m", "venv", "--clear", str(root)], check=True, timeout=300)
        pip = subprocess.run([str(root / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                              f"torch=={OLDEST_TORCH}"], capture_output=True, text=True, timeout=1800)
        check = subprocess.run([str(root / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                               capture_output=True, text=True, timeout=300)
        if pip.returncode != 0 or not check.stdout.startswith(OLDEST_TORCH):
            raise RuntimeError(f"could not install torch=={OLDEST_TORCH} into {root}: {pip.stderr[-2000:]}"
                               f"{check.stderr[-2000:]}")
        (root / ".ok").write_text(check.stdout)
    return root


def main() -> int:
    try:
        print(f">> PyTorch {OLDEST_TORCH} (the oldest supported) in {oldest_torch_venv()}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        print(f">> no PyTorch {OLDEST_TORCH} venv ({error}); test_torchrun_oldest.py will try again", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
