"""What `gpuguard config --check` says beyond a valid file: settings that validate but will not work as meant on
the node. Root's writes go through gpuguard.util.trust, so a path where root may not write (a user's symlink on
the way, a directory a user may write) is refused at run time: say it before deploying. And the Alertmanager
inhibition of a drained node's metric alerts matches on `cluster`, which only Prometheus' external_labels give."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Optional

from gpuguard.util.trust import untrusted_reason

if TYPE_CHECKING:
    from gpuguard.config.schema import Config


def _here(path: str) -> str:
    return path.replace("{node}", socket.gethostname().split(".")[0])


def root_write_paths(cfg: "Config") -> list[tuple[str, str, bool]]:
    """(setting, directory root writes in, whether a sticky world-writable directory may hold it)."""
    out: list[tuple[str, str, bool]] = []
    if cfg.logging.file:
        out.append(("logging.file", os.path.dirname(os.path.abspath(cfg.logging.file)), True))
    if cfg.metrics.textfile_dir:  # every *.prom there is served: no directory a user may write, sticky or not
        out.append(("metrics.textfile_dir", os.path.abspath(cfg.metrics.textfile_dir), False))
    out.append(("store.path", os.path.dirname(os.path.abspath(cfg.store.path)), False))
    if cfg.notify.state_path:
        out.append(("notify.state_path", os.path.dirname(os.path.abspath(cfg.notify.state_path)), False))
    return out


def untrusted_warnings(cfg: "Config") -> list[str]:
    out = []
    for setting, directory, sticky_ok in root_write_paths(cfg):
        why: Optional[str] = untrusted_reason(_here(directory), sticky_end=sticky_ok)
        if why:
            out.append(f"{setting}: {why}: root will not write there (a user could redirect or forge it); use a "
                       f"directory only root may write")
    return out


def cluster_label_advice(cfg: "Config") -> list[str]:
    if not cfg.notify.cluster:
        return []
    return [f"notify.cluster is {cfg.notify.cluster!r}: set `global: external_labels: {{cluster: "
            f"{cfg.notify.cluster}}}` in prometheus.yml, else Alertmanager's inhibition (equal: [cluster, node]) "
            f"does not silence a drained node's metric alerts (docs/alerts.md)"]


def config_advice(cfg: "Config") -> list[str]:
    """Every warning for `gpuguard config --check` (none: nothing to add). Creates nothing."""
    return untrusted_warnings(cfg) + cluster_label_advice(cfg)
