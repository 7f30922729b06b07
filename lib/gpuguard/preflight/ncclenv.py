"""The NCCL environment preset the pre-flight's nccl-tests ranks run with: the same tuned NCCL/EFA variables the
templates export for their ranks (gpuguard.templates.presets: `data/presets.yaml` with the site's
`templates.presets` merged over it), so that the pre-flight measures the fabric as the training will use it.

Which preset: `nccl.sweep_preset` (what the sweep's nccl-tests job gets), else the profile (`node.profile`) when a
preset of that name exists, else `generic` (both templates' default). A variable the batch script already has keeps
its value: under the torchrun template that is the preset plus the job's own `env:` overrides, which the preset
must not undo. Variables placed under a runtime directory (`under: job_dir|attempt_dir|local_dir`: flight-recorder
dumps, caches) and the preset's `unset:` list are the job's business, not the pre-flight's: not applied. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gpuguard.templates.presets import Preset, PresetError, load_presets, resolve_preset

DEFAULT_PRESET = "generic"


@dataclass(frozen=True)
class PresetEnv:
    env: dict[str, str]  # what the ranks get on top of the batch script's environment
    note: str  # for the job line: "preset generic / none" or why none was applied


def preset_name(sweep_preset: Optional[str], profile: str, site_presets: Mapping[str, Any]) -> str:
    """`nccl.sweep_preset`, else the profile when it names a preset, else `generic`."""
    if sweep_preset:
        return sweep_preset
    try:
        known = load_presets(site_presets).get("instances", {})
    except PresetError:
        known = {}
    return profile if profile in known else DEFAULT_PRESET


def to_add(preset: Preset, environ: Mapping[str, str]) -> dict[str, str]:
    """The preset's variables the environment does not already set (none placed under a runtime directory)."""
    return {e.name: e.value for e in preset.env
            if e.value is not None and e.under is None and e.name not in environ}


def preflight_preset_env(sweep_preset: Optional[str], profile: str, site_presets: Mapping[str, Any],
                         environ: Mapping[str, str]) -> PresetEnv:
    name = preset_name(sweep_preset, profile, site_presets)
    try:
        preset = resolve_preset(name, None, site_presets)
    except PresetError as e:
        return PresetEnv({}, f"NCCL preset not applied: {e}")
    add = to_add(preset, environ)
    return PresetEnv(add, f"NCCL preset {preset.label} ({len(add)} set)")
