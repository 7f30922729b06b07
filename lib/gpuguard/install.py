"""Install the three slurmd hook executables with the settings they need (used by `make install`,
the demo and the integration tests, so all three exercise the same files)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from pathlib import Path
from typing import Optional

HOOKS = {"prolog": "gpuguard-prolog", "epilog": "gpuguard-epilog", "healthcheck": "gpuguard-healthcheck"}


def repo_root() -> Optional[Path]:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "prolog" / "gpuguard-prolog").is_file():
            return parent
    return None


def install_hooks(libexec: Path, python: str, config: Optional[str], source: Optional[Path] = None) -> dict[str, Path]:
    """Copy the hook scripts into `libexec` and write `gpuguard.env` beside them."""
    src = source or repo_root()
    if src is None:
        raise FileNotFoundError("hook scripts not found (run from a gpuguard checkout)")
    libexec.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for kind, name in HOOKS.items():
        dest = libexec / name
        tmp = libexec / f".{name}.tmp"
        shutil.copyfile(src / kind / name, tmp)
        tmp.chmod(0o755)
        os.replace(tmp, dest)
        out[kind] = dest
    lines = ["# written by gpuguard install: settings for the slurmd hooks beside this file",
             f"GPUGUARD_PYTHON={shlex.quote(python)}"]
    if config:
        lines.append(f"GPUGUARD_CONFIG={shlex.quote(config)}")
    env = libexec / "gpuguard.env"
    env.write_text("\n".join(lines) + "\n")
    env.chmod(0o644)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description="install gpuguard's slurmd hooks")
    ap.add_argument("--libexec", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--config")
    a = ap.parse_args()
    for kind, path in install_hooks(Path(a.libexec), a.python, a.config).items():
        print(f"installed {kind:<12} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
