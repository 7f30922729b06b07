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


def install_hooks(libexec: Path, python: str, config: Optional[str], source: Optional[Path] = None,
                  state_dir: Optional[str] = None, runtime_dir: Optional[str] = None) -> dict[str, Path]:
    """Copy the hook scripts into `libexec` and write `gpuguard.env` beside them. `state_dir`: where the hooks keep
    the last good configuration (default /var/lib/gpuguard); `runtime_dir`: their verdict journals when the config
    names none or cannot be read (default /run/gpuguard). Both matter where several nodes share one host."""
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
    if state_dir:
        lines.append(f"GPUGUARD_STATE_DIR={shlex.quote(state_dir)}")
    if runtime_dir:
        lines.append(f"GPUGUARD_RUNTIME_DIR={shlex.quote(runtime_dir)}")
    env = libexec / "gpuguard.env"
    env.write_text("\n".join(lines) + "\n")
    env.chmod(0o644)
    return out


CONFIG_MODE = 0o640  # root rw, the admin group r, nobody else: notification URLs carry tokens (Slack, PagerDuty)


def install_config(example: Path, dest: Path) -> str:
    """Put the example config at `dest` unless one is there (never overwritten), private: 0640 in a 0755
    directory, created without a window in which it is world-readable. An existing config readable or writable by
    others is tightened (it may already hold tokens). Returns what was done."""
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        tmp = dest.with_name(f".{dest.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, CONFIG_MODE)
        try:
            os.write(fd, example.read_bytes())
            os.fchmod(fd, CONFIG_MODE)  # whatever the umask
        finally:
            os.close(fd)
        os.replace(tmp, dest)
        return f"installed {dest} (mode {CONFIG_MODE:o})"
    import stat

    if stat.S_ISLNK(st.st_mode):
        return f"kept {dest}: a symbolic link, not touched"
    if st.st_mode & 0o007:
        os.chmod(dest, stat.S_IMODE(st.st_mode) & ~0o007)
        return f"kept {dest}; removed its permissions for others (was {stat.S_IMODE(st.st_mode):o}): it may hold tokens"
    return f"kept {dest} (never overwritten)"


def main() -> int:
    ap = argparse.ArgumentParser(description="install gpuguard's slurmd hooks")
    ap.add_argument("--libexec")
    ap.add_argument("--python")
    ap.add_argument("--config")
    ap.add_argument("--install-config", metavar="EXAMPLE", help="install EXAMPLE at --config (never overwritten)")
    a = ap.parse_args()
    if a.install_config:
        if not a.config:
            ap.error("--install-config needs --config")
        print(install_config(Path(a.install_config), Path(a.config)))
        return 0
    if not (a.libexec and a.python):
        ap.error("--libexec and --python are required")
    for kind, path in install_hooks(Path(a.libexec), a.python, a.config).items():
        print(f"installed {kind:<12} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
