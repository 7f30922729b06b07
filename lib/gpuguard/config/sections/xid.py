"""The `xid:` section: site overrides of NVIDIA's Xid catalog (gpuguard.xid.catalog)."""

from __future__ import annotations

from typing import Any

from gpuguard.config.fields import Section, key, mapping, section


@section
class XidConfig(Section):
    """`xid:` per-code overrides, e.g. {79: {severity: fatal, action: reboot}}; keys are Xid codes (integers) or
    "unknown". The loader checks them against the catalog (gpuguard.config.schema); a bad one keeps none."""

    overrides: dict[Any, dict[str, Any]] = key(mapping, {})
