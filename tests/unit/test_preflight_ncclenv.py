"""The NCCL environment preset the pre-flight's nccl-tests ranks get (gpuguard.preflight.ncclenv): the same preset
data the templates export (shipped presets.yaml plus the site's templates.presets), what the batch script already set
winning, nothing placed under a job's runtime directories."""

from __future__ import annotations

from gpuguard.preflight.ncclenv import preflight_preset_env, preset_name
from gpuguard.templates.presets import resolve_preset

SITE = {"common": {"env": [{"name": "NCCL_BUFFSIZE", "value": "2097152", "why": "site tuning"}]}}


def test_the_preset_is_sweep_preset_else_the_profile_when_one_exists_else_generic():
    assert preset_name("p5.48xlarge", "generic", {}) == "p5.48xlarge"
    assert preset_name(None, "p5.48xlarge", {}) == "p5.48xlarge"
    assert preset_name(None, "my-lab-profile", {}) == "generic"


def test_the_ranks_get_the_presets_variables_the_batch_script_lacks():
    got = preflight_preset_env(None, "generic", SITE, {"NCCL_DEBUG": "INFO"})
    generic = resolve_preset("generic", None, SITE)
    assert got.env["NCCL_BUFFSIZE"] == "2097152" and got.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "NCCL_DEBUG" not in got.env  # the job's (or the torchrun template's) own value stays
    # a flight-recorder dump path or a cache under the job's directories is the job's, not the pre-flight's
    assert {e.name for e in generic.env if e.under} and not {e.name for e in generic.env if e.under} & set(got.env)
    assert got.note == f"NCCL preset {generic.label} ({len(got.env)} set)"


def test_an_efa_instance_preset_brings_its_fabric_variables():
    got = preflight_preset_env(None, "p5.48xlarge", {}, {})
    p5 = resolve_preset("p5.48xlarge")
    assert got.env == {e.name: e.value for e in p5.env if e.value is not None and e.under is None}
    assert any(name.startswith("FI_") for name in got.env), got.env


def test_an_unknown_sweep_preset_applies_nothing_and_says_why():
    got = preflight_preset_env("p9.nope", "generic", {}, {})
    assert got.env == {} and got.note.startswith("NCCL preset not applied: preset: unknown instance type 'p9.nope'")
