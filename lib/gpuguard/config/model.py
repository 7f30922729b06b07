"""The typed configuration: `Config`, one frozen dataclass per section (a feature's in gpuguard/config/sections/:
`WatchConfig` in sections/watch.py, ...; the hook run's own sections in gpuguard/config/core.py), held as attributes
(`cfg.deadlines.prolog_s`, `cfg.watch.start_at`, `cfg.checks.enabled("gpu.nvlink")`). Reading a file into it is
gpuguard.config.schema's (load_config, parse_config) and gpuguard.config.parse's (validation); the hooks' hot path
builds it from the compiled last good copy (gpuguard.config.lastgood) with no YAML.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from gpuguard.config.checks import ChecksConfig
from gpuguard.config.core import (DeadlinesConfig, EpilogConfig, LockingConfig, LoggingConfig, NodeConfig,
                                  PolicyConfig, RebootConfig, SourcesConfig, UndrainConfig)
from gpuguard.config.fields import Section
from gpuguard.config.sections.metrics import MetricsConfig
from gpuguard.config.sections.monitor import MonitorConfig
from gpuguard.config.sections.nccl import NcclConfig
from gpuguard.config.sections.notify import NotifyConfig
from gpuguard.config.sections.simulate import SimulationConfig
from gpuguard.config.sections.slurm import SlurmConfig
from gpuguard.config.sections.store import StoreConfig
from gpuguard.config.sections.templates import TemplatesConfig
from gpuguard.util.record import Frozen, Record, field, record, replace
from gpuguard.config.sections.watch import WatchConfig
from gpuguard.config.sections.xid import XidConfig

DEFAULT_CONFIG_PATH = "/etc/gpuguard/config.yaml"
ENV_CONFIG = "GPUGUARD_CONFIG"


class ConfigError(ValueError):
    """Bad configuration. The message names the file, the line and the key."""


@record
class ConfigIssue(Frozen):
    """One thing wrong in a config file: the key path (or "(file)"), its line when known, what is wrong."""

    path: str
    line: Optional[int]
    message: str
    meant: Optional[str] = None  # for an unknown key: the known key it most likely misspells (full path)

    def __str__(self) -> str:
        return f"{'line ' + str(self.line) + ': ' if self.line else ''}{self.path}: {self.message}"


@record
class Config(Record):
    """The configuration a run uses: one typed section per YAML section, in the file's documented order (what
    `gpuguard config` prints), the per-check settings, and what was wrong with the file it stands in for."""

    source: str = "<defaults>"
    node: NodeConfig = field(default_factory=NodeConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    deadlines: DeadlinesConfig = field(default_factory=DeadlinesConfig)
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    xid: XidConfig = field(default_factory=XidConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    locking: LockingConfig = field(default_factory=LockingConfig)
    undrain: UndrainConfig = field(default_factory=UndrainConfig)
    reboot: RebootConfig = field(default_factory=RebootConfig)
    epilog: EpilogConfig = field(default_factory=EpilogConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    templates: TemplatesConfig = field(default_factory=TemplatesConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    # What was wrong with the file this config stands in for (gpuguard.config.lastgood): "ok", "partial" (bad keys
    # took their last good value), "last-good" (the file could not be used: the last config that validated), or
    # "defaults" (nothing usable: built-in defaults, and only unambiguous hardware evidence drains).
    mode: str = "ok"
    issues: list[ConfigIssue] = field(default_factory=list)
    last_good_at: Optional[float] = None  # when the configuration used for the bad parts was validated
    given: set[str] = field(default_factory=set)  # key paths the file set validly ("deadlines.prolog_s", ...)

    @property
    def restricted(self) -> bool:
        return self.mode == "defaults"

    def check_enabled(self, check_id: str) -> bool:
        return self.checks.enabled(check_id)

    def check_params(self, check_id: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return self.checks.params(check_id, defaults)

    def as_mapping(self) -> dict[str, dict[str, Any]]:
        """section -> key -> value (copies), for display (`gpuguard config`, passwords redacted there) and the
        compiled last good configuration. Features read the typed attributes, never this."""
        return {name: getattr(self, name).as_mapping() for name in SECTIONS}

    def redacted_mapping(self) -> dict[str, dict[str, Any]]:
        """`as_mapping()` without secrets, for `gpuguard config`: notification URLs by scheme only, Alertmanager
        URLs and the PostgreSQL URL with their passwords masked. The config is not changed."""
        from gpuguard.util.redact import redact_notify_url, redact_url  # cold: urllib.parse, ipaddress

        out = self.as_mapping()
        out["notify"]["urls"] = [redact_notify_url(u) for u in self.notify.urls]
        out["notify"]["alertmanager_urls"] = [redact_url(u) for u in self.notify.alertmanager_urls]
        if self.store.url:
            out["store"]["url"] = redact_url(self.store.url)
        return out

    def with_key(self, section: str, key: str, value: Any) -> None:
        """Set one key (the loader's merge of a last good value); the section stays frozen, a new one replaces it."""
        setattr(self, section, replace(getattr(self, section), **{key: value}))


# section name -> its dataclass, in the file's documented order (`checks:` is validated against the registry)
SECTIONS: dict[str, type[Section]] = {name: factory for name, _, factory, _ in Config._fields
                                      if isinstance(factory, type) and issubclass(factory, Section) and name != "checks"}


def default_config(source: str = "<defaults>") -> Config:
    return Config(source=source)


def config_from_mapping(sections: Mapping[str, Any], checks: Mapping[str, Any], source: str) -> Config:
    """A Config from `as_mapping()`'s form, trusted (the compiled last good configuration, validated when it was
    compiled): unknown sections and keys are dropped, missing keys take their defaults."""
    built: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        values = sections.get(name)
        if isinstance(values, dict):
            built[name] = cls.from_trusted(values)
    given = {k: dict(v) for k, v in checks.items() if isinstance(v, dict)}
    return Config.from_trusted({"source": source, "checks": ChecksConfig.from_trusted({"given": given}), **built})


