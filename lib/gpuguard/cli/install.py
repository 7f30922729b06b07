"""Install the three slurmd hook executables with the settings they need (used by `make install`,
the demo and the integration tests, so all three exercise the same files)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Mapping, Optional

HOOKS = {"prolog": "gpuguard-prolog", "epilog": "gpuguard-epilog", "healthcheck": "gpuguard-healthcheck"}


def repo_root() -> Optional[Path]:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "prolog" / "gpuguard-prolog").is_file():
            return parent
    return None


ENV_HEADER = ("# gpuguard.env: settings for the slurmd hooks beside this file (and the watch units' EnvironmentFile).\n"
              "# `make install` sets GPUGUARD_PYTHON (and GPUGUARD_CONFIG when this file has none or CONFDIR= is\n"
              "# given); every other line is the site's and survives upgrades (GPUGUARD_STATE_DIR, ...).")
_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=")


def merge_env(existing: str, settings: Mapping[str, str], if_unset: Mapping[str, str]) -> str:
    """gpuguard.env with `settings` set and `if_unset` added where the file has no such line; every other line (a
    site's own settings, comments) kept as it was. A key set again replaces its first line; later lines setting it
    (which the shell would have let win) go."""
    lines = existing.splitlines() if existing.strip() else ENV_HEADER.splitlines()
    present = {m.group(1) for m in map(_ASSIGNMENT.match, lines) if m}
    wanted = {**settings, **{k: v for k, v in if_unset.items() if k not in present and k not in settings}}
    out, done = [], set()
    for line in lines:
        m = _ASSIGNMENT.match(line)
        key = m.group(1) if m else None
        if key in wanted:
            if key not in done:
                out.append(f"{key}={shlex.quote(wanted[key])}")
                done.add(key)
            continue
        out.append(line)
    out.extend(f"{k}={shlex.quote(v)}" for k, v in wanted.items() if k not in done)
    return "\n".join(out) + "\n"


def write_env(path: Path, settings: Mapping[str, str], if_unset: Mapping[str, str]) -> None:
    """Rewrite gpuguard.env in one rename: a hook starting meanwhile reads the old file or the new one."""
    try:
        existing = path.read_text()
    except FileNotFoundError:
        existing = ""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(merge_env(existing, settings, if_unset))
    tmp.chmod(0o644)
    os.replace(tmp, path)


def install_hooks(libexec: Path, python: str, config: Optional[str], source: Optional[Path] = None,
                  state_dir: Optional[str] = None, runtime_dir: Optional[str] = None,
                  config_if_unset: bool = False) -> dict[str, Path]:
    """Copy the hook scripts into `libexec` and write `gpuguard.env` beside them, keeping what a site added to it.
    `state_dir`: where the hooks keep the last good configuration (default /var/lib/gpuguard); `runtime_dir`: their
    verdict journals when the config names none or cannot be read (default /run/gpuguard). Both matter where several
    nodes share one host. `config_if_unset`: `config` only where the file names none."""
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
    settings = {"GPUGUARD_PYTHON": python}
    for key, value in (("GPUGUARD_CONFIG", config), ("GPUGUARD_STATE_DIR", state_dir),
                       ("GPUGUARD_RUNTIME_DIR", runtime_dir)):
        if value:
            settings[key] = value
    if_unset = {"GPUGUARD_CONFIG": settings.pop("GPUGUARD_CONFIG")} if config_if_unset and config else {}
    write_env(libexec / "gpuguard.env", settings, if_unset)
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
    ap.add_argument("--default-config", metavar="CONFIG", help="--config, only where gpuguard.env names none")
    ap.add_argument("--install-config", metavar="EXAMPLE", help="install EXAMPLE at --config (never overwritten)")
    a = ap.parse_args()
    if a.install_config:
        if not a.config:
            ap.error("--install-config needs --config")
        print(install_config(Path(a.install_config), Path(a.config)))
        return 0
    if not (a.libexec and a.python):
        ap.error("--libexec and --python are required")
    config = a.config or a.default_config
    for kind, path in install_hooks(Path(a.libexec), a.python, config, config_if_unset=not a.config).items():
        print(f"installed {kind:<12} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
