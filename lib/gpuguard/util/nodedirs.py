"""The two directories of a node every part of gpuguard agrees on, in one place. Both come from `gpuguard.env`
beside the hook scripts (written by `gpuguard install` / `make install`), which matters where several nodes share
one host (the dev cluster); on a real node the defaults are what they are.

- the state directory (`$GPUGUARD_STATE_DIR`, default /var/lib/gpuguard): the last good configuration, compiled
  profiles, the node agent's socket, and the history store's default home (`store.path`);
- the runtime directory (`$GPUGUARD_RUNTIME_DIR`, default /run/gpuguard, a tmpfs): the verdict journals, unless
  `store.runtime_dir` names another.
Imports nothing but `os`: the hooks' hot path and the node agent's client read it."""

from __future__ import annotations

import os

ENV_STATE_DIR = "GPUGUARD_STATE_DIR"
DEFAULT_STATE_DIR = "/var/lib/gpuguard"
ENV_RUNTIME_DIR = "GPUGUARD_RUNTIME_DIR"
DEFAULT_RUNTIME_DIR = "/run/gpuguard"


def state_dir(environ: "os._Environ[str] | dict[str, str] | None" = None) -> str:  # no typing: the hook client
    return (os.environ if environ is None else environ).get(ENV_STATE_DIR) or DEFAULT_STATE_DIR


def runtime_dir_from_env(environ: "os._Environ[str] | dict[str, str] | None" = None) -> str:
    return (os.environ if environ is None else environ).get(ENV_RUNTIME_DIR) or DEFAULT_RUNTIME_DIR


def default_store_path() -> str:
    """`store.path` when the config names none: state.db in the state directory, read when the config is built (so a
    site whose gpuguard.env moves the state directory moves the store with it)."""
    return os.path.join(state_dir(), "state.db")
