"""The configuration the hooks and the watch daemon run with: a config mistake never switches protection off.

One file is deployed to every node at once, so a typo in it is a typo everywhere. Failing open (pass every node)
lets broken nodes take jobs fleet-wide; failing closed drains the fleet. Instead:

- every config that validates is kept, compiled to JSON, as the *last good* one (`$GPUGUARD_STATE_DIR`, default
  /var/lib/gpuguard, 0600: notification URLs carry tokens). While the file is unchanged the hooks read that JSON
  and skip YAML entirely (the prolog's hot path);
- a file with bad keys (unknown, misspelt, wrong type) keeps every good key and takes the last good value, or the
  default, for each bad one (`mode` "partial");
- a file that cannot be used at all (YAML error, not a mapping, missing, unreadable) is replaced by the last good
  configuration whole (`mode` "last-good"); with none, by built-in defaults on which only unambiguous hardware
  evidence drains (`mode` "defaults": gpuguard.pipeline.decide);
- the mistake is loud: every run logs it, the verdict journal and `gpuguard status` show it, a metric and a
  notification through the last good receivers say it (gpuguard.pipeline.run).

`gpuguard config --check FILE` validates a file before it is deployed, naming every bad key with its line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Optional

from gpuguard.config.compiled import read_trusted_json
from gpuguard.config.schema import (SECTIONS, CheckParams, Config, ConfigError, ConfigIssue, config_from_mapping,
                                    config_path, default_config, parse_config)
from gpuguard.util.digest import sha256_hex
from gpuguard.util.fs import atomic_write
from gpuguard.util.nodedirs import state_dir
from gpuguard.util.record import field_names

CACHE_VERSION = 1


def cache_path(config_file: str, directory: Optional[str] = None) -> str:
    key = sha256_hex(os.path.abspath(config_file).encode())[:16]
    return os.path.join(directory or state_dir(), f"config-{key}.last-good.json")


# --------------------------------------------------------------------------- the compiled copy


def _encode(cfg: Config, digest: str) -> str:
    """The compiled copy: `Config.as_mapping()` as JSON (the format of cache version 1)."""
    compiled = cfg.as_mapping()
    compiled["xid"]["overrides"] = [[k, v] for k, v in cfg.xid.overrides.items()]  # int keys survive JSON
    return json.dumps({"version": CACHE_VERSION, "digest": digest, "source": cfg.source, "validated_at": time.time(),
                       "sections": compiled, "checks": cfg.checks.as_mapping()}, sort_keys=True)


def _decode(doc: dict[str, Any]) -> Config:
    compiled = dict(doc.get("sections") or {})
    xid = compiled.get("xid")
    if isinstance(xid, dict):
        overrides = xid.get("overrides")
        compiled["xid"] = {**xid, "overrides": {k: v for k, v in overrides} if isinstance(overrides, list) else {}}
    cfg = config_from_mapping(compiled, doc.get("checks") or {}, str(doc.get("source") or "<last good>"))
    cfg.last_good_at = float(doc.get("validated_at") or 0) or None
    return cfg


def read_last_good(path: str) -> Optional[tuple[Config, str]]:
    """(config, digest of the file it was compiled from), or None. Trusted only when owned by us and writable by
    nobody else: it decides what root hooks do."""
    doc = read_trusted_json(path)
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION:
        return None
    try:
        return _decode(doc), str(doc.get("digest") or "")
    except (TypeError, ValueError, AttributeError):
        return None


def write_last_good(path: str, cfg: Config, digest: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        atomic_write(path, _encode(cfg, digest), mode=0o600)
    except OSError:
        pass  # no copy this time: the next run that validates writes it


# --------------------------------------------------------------------------- loading


def read_bounded(path: str, timeout_s: float) -> bytes:
    """The file's bytes, or OSError: a config on a hung filesystem (NFS) must not hang a prolog."""
    box: dict[str, Any] = {}

    def read() -> None:
        try:
            with open(path, "rb") as f:
                box["data"] = f.read()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=read, name="gpuguard-config-read", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"reading it did not finish within {timeout_s:g}s (hung filesystem?)")
    if "error" in box:
        raise box["error"]
    return bytes(box["data"])


def load_guarded(explicit: Optional[str] = None, directory: Optional[str] = None, read_timeout_s: float = 10.0, *,
                 check_params: Callable[[], CheckParams]) -> Config:
    """The config to run with. Never raises ConfigError: what is wrong is in `issues` and `mode`. `check_params`
    is called only when the file must be parsed (the hot path reads the compiled copy and never builds the check
    registry for it); gpuguard.siteconfig.load_guarded gives the registry's."""
    path, must_exist = config_path(explicit)
    cache = cache_path(path, directory)
    try:
        raw = read_bounded(path, read_timeout_s)
    except FileNotFoundError:
        if not must_exist:  # a site that never wrote one: the defaults are its configuration
            return default_config(f"{path} (absent: defaults)")
        return _fallback(cache, path, ConfigIssue("(file)", None, "config file not found"))
    except PermissionError:
        return _fallback(cache, path, ConfigIssue("(file)", None, f"{PERMISSION_DENIED} {path} as uid {os.geteuid()}"
                                                                  " (gpuguard runs as root)"))
    except OSError as e:
        return _fallback(cache, path, ConfigIssue("(file)", None, f"cannot read: {e}"))
    digest = sha256_hex(raw)
    last = read_last_good(cache)
    if last is not None and last[1] == digest:
        cfg = last[0]  # the file validated as it is now: no YAML on the hot path
        cfg.source, cfg.last_good_at = path, None
        return cfg
    try:
        cfg = parse_config(raw.decode("utf-8"), source=path, check_params=check_params(), lenient=True)
    except (ConfigError, UnicodeDecodeError) as e:
        return _fallback(cache, path, ConfigIssue("(file)", None, _strip_source(str(e), path)), last)
    if not cfg.issues:
        write_last_good(cache, cfg, digest)
        return cfg
    return _merge_last_good(cfg, last[0] if last else None)


def _strip_source(msg: str, path: str) -> str:
    return msg[len(path) + 2:] if msg.startswith(path + ": ") else msg


def _fallback(cache: str, path: str, issue: ConfigIssue,
              last: Optional[tuple[Config, str]] = None) -> Config:
    last = last or read_last_good(cache)
    if last is not None:
        cfg = last[0]
        cfg.source, cfg.mode, cfg.issues = f"{path} (unusable: last good configuration)", "last-good", [issue]
        return cfg
    cfg = default_config(f"{path} (unusable, no last good configuration: built-in defaults)")
    cfg.mode, cfg.issues = "defaults", [issue]
    return cfg


def _merge_last_good(cfg: Config, last: Optional[Config]) -> Config:
    """Each bad key of `cfg` takes its last good value (its default stays when there is none)."""
    if last is not None:
        cfg.last_good_at = last.last_good_at
        for issue in cfg.issues:
            target = issue.meant if issue.meant and issue.meant not in cfg.given else issue.path
            parts = target.split(".")  # a misspelt key: the one it most likely meant, unless the file set that too
            if parts[0] == "checks" and len(parts) >= 3:
                check_id, param = ".".join(parts[1:-1]), parts[-1]
                if param in last.checks.given.get(check_id, {}):
                    cfg.checks = cfg.checks.with_param(check_id, param, last.checks.given[check_id][param])
            elif parts[0] == "xid":
                cfg.xid = last.xid
            elif len(parts) == 2 and parts[1] in _keys_of(parts[0]):
                cfg.with_key(parts[0], parts[1], getattr(getattr(last, parts[0]), parts[1]))
    return cfg


def _keys_of(section: str) -> tuple[str, ...]:
    cls = SECTIONS.get(section)
    return field_names(cls) if cls is not None else ()


def check_file(path: str, *, check_params: CheckParams) -> list[ConfigIssue]:
    """Every problem of a config file (for `gpuguard config --check` before deploying it)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return [ConfigIssue("(file)", None, f"cannot read: {e}")]
    try:
        return parse_config(text, source=path, check_params=check_params, lenient=True).issues
    except ConfigError as e:
        return [ConfigIssue("(file)", None, _strip_source(str(e), path))]


PERMISSION_DENIED = "permission denied reading"


def unreadable_by_this_user(cfg: Config) -> Optional[str]:
    """The message when the config could not be read for want of permission (a user ran what root must run), else
    None: that is the user's problem to hear about, not a broken config."""
    return next((i.message for i in cfg.issues if i.path == "(file)" and i.message.startswith(PERMISSION_DENIED)),
                None)


def describe(cfg: Config) -> str:
    """One line for logs and status: what is wrong and what gpuguard runs with instead."""
    what = {"partial": "bad keys keep their last good value (or default)",
            "last-good": "the whole file is ignored: running with the last good configuration",
            "defaults": "no last good configuration: built-in defaults, only unambiguous hardware evidence drains"}
    shown = "; ".join(str(i) for i in cfg.issues[:5]) + (f"; +{len(cfg.issues) - 5} more" if len(cfg.issues) > 5 else "")
    return f"config broken ({cfg.source}): {shown} -> {what.get(cfg.mode, cfg.mode)}"
