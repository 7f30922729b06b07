"""Shipped instance profiles: they load, are internally consistent, and carry their sources."""

from __future__ import annotations

from pathlib import Path

import pytest


from gpuguard.profiles import PROFILE_DIR, PROFILE_FIELDS, Profile, list_profiles, load_profile  # noqa: E402
from gpuguard.config.yamlutil import load_yaml_file  # noqa: E402

REQUIRED = {
    "p4d.24xlarge",
    "p4de.24xlarge",
    "p5.48xlarge",
    "p5e.48xlarge",
    "p5en.48xlarge",
    "p6-b200.48xlarge",
    "dgx-h100-ib",
    "generic",
}
EC2_P_INSTANCES = sorted(n for n in REQUIRED if n.startswith("p"))
SHIPPED = sorted(p.stem for p in Path(PROFILE_DIR).glob("*.yaml"))

# What each EC2 profile must say (AWS "Specifications for Amazon EC2 accelerated computing instances":
# GPUs, vCPUs, network cards = max EFAs). Repeated here on purpose: a typo in a YAML file fails a test.
EXPECTED_EC2 = {
    "p4d.24xlarge": ("NVIDIA A100-SXM4-40GB", 40960, 12, 4, 96),
    "p4de.24xlarge": ("NVIDIA A100-SXM4-80GB", 81920, 12, 4, 96),
    "p5.48xlarge": ("NVIDIA H100 80GB HBM3", 81559, 18, 32, 192),
    "p5e.48xlarge": ("NVIDIA H200", 143771, 18, 32, 192),
    "p5en.48xlarge": ("NVIDIA H200", 143771, 18, 16, 192),
    "p6-b200.48xlarge": ("NVIDIA B200", 183359, 18, 8, 192),
}


def test_required_profiles_are_shipped() -> None:
    assert REQUIRED <= set(SHIPPED)
    assert REQUIRED <= set(list_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_loads_and_name_is_file_stem(name: str) -> None:
    prof = load_profile(name)
    assert isinstance(prof, Profile)
    assert prof.name == name
    assert prof.description


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_keys_are_profile_fields(name: str) -> None:
    data = load_yaml_file(Path(PROFILE_DIR) / f"{name}.yaml")
    assert isinstance(data, dict)
    assert set(data) <= set(PROFILE_FIELDS)


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_cites_its_sources(name: str) -> None:
    text = (Path(PROFILE_DIR) / f"{name}.yaml").read_text(encoding="utf-8")
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert header, "a profile starts with a comment header citing its sources"
    assert any("https://" in ln for ln in header)


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_values_are_consistent(name: str) -> None:
    p = load_profile(name)
    if p.gpu_temp_warn_c is not None and p.gpu_temp_fail_c is not None:
        assert p.gpu_temp_warn_c < p.gpu_temp_fail_c
    for temp in (p.gpu_temp_warn_c, p.gpu_temp_fail_c):
        assert temp is None or 60 <= temp <= 95
    for count in (p.gpu_count, p.nvlinks_per_gpu, p.efa_devices, p.ib_devices, p.cpus, p.memory_gib):
        assert count is None or (isinstance(count, int) and not isinstance(count, bool) and count > 0)
    assert p.pcie_gen is None or p.pcie_gen in (3, 4, 5, 6)
    assert p.pcie_width is None or p.pcie_width in (1, 2, 4, 8, 16)
    assert 0 <= p.gpu_memory_tolerance_pct <= 10
    if p.gpu_memory_mib is not None:
        assert p.gpu_count is not None and p.gpu_model is not None
    if p.efa_devices:
        assert p.libfabric_provider == "efa"
    if p.ib_devices:
        assert p.ib_device_pattern and p.ib_rate_gbps
    # libfabric/EFA and IB compute fabrics are alternatives on the nodes described here
    assert not (p.efa_devices and p.ib_devices)
    if p.gpu_model is not None:
        assert p.gpu_model.startswith("NVIDIA "), "the exact NVML name, so 'B200' cannot match 'GB200'"


@pytest.mark.parametrize("name", EC2_P_INSTANCES)
def test_ec2_p_instances(name: str) -> None:
    p = load_profile(name)
    model, mem_mib, nvlinks, efa, cpus = EXPECTED_EC2[name]
    assert p.instance_types == (name,)
    assert p.gpu_count == 8
    assert (p.gpu_model, p.gpu_memory_mib, p.nvlinks_per_gpu) == (model, mem_mib, nvlinks)
    assert (p.efa_devices, p.libfabric_provider, p.cpus) == (efa, "efa", cpus)
    assert p.ib_devices is None
    assert p.memory_gib is not None


def test_p5_is_8_h100_with_32_efa() -> None:
    p = load_profile("p5.48xlarge")
    assert p.gpu_count == 8
    assert "H100" in (p.gpu_model or "")
    assert p.efa_devices == 32
    assert p.gpu_memory_mib == 81559


def test_memory_floor_is_below_nominal() -> None:
    # MemTotal never reaches the nominal size: a floor at the nominal value would fail every healthy node
    nominal_gib = {"p4d.24xlarge": 1152, "p4de.24xlarge": 1152}
    for name in EC2_P_INSTANCES:
        p = load_profile(name)
        assert p.memory_gib is not None
        nominal = nominal_gib.get(name, 2048)
        assert 0.9 * nominal <= p.memory_gib < nominal


def test_instance_types_are_unique_across_profiles() -> None:
    owner: dict[str, str] = {}
    for name in SHIPPED:
        for itype in load_profile(name).instance_types:
            assert itype not in owner, f"{itype} claimed by {owner.get(itype)} and {name}"
            owner[itype] = name


def test_lookup_by_instance_type_and_site_override(tmp_path: Path) -> None:
    # site profile directory wins over the shipped one
    (tmp_path / "p5.48xlarge.yaml").write_text("gpu_count: 8\nefa_devices: 16\n")
    assert load_profile("p5.48xlarge", extra_dir=str(tmp_path)).efa_devices == 16
    assert load_profile("p5.48xlarge").efa_devices == 32


def test_generic_has_no_hardware_expectations() -> None:
    g = load_profile("generic")
    hardware = (
        "gpu_count gpu_model gpu_memory_mib nvlinks_per_gpu pcie_gen pcie_width efa_devices ib_devices "
        "ib_device_pattern ib_rate_gbps libfabric_provider cpus memory_gib nccl_busbw_gbps"
    ).split()
    assert all(getattr(g, f) is None for f in hardware)
    assert g.instance_types == ()
    assert g.gpu_temp_fail_c is not None  # a universal safety limit is still there


def test_dgx_h100_ib() -> None:
    d = load_profile("dgx-h100-ib")
    assert (d.gpu_count, d.gpu_model, d.nvlinks_per_gpu) == (8, "NVIDIA H100 80GB HBM3", 18)
    assert (d.ib_devices, d.ib_device_pattern, d.ib_rate_gbps) == (8, "mlx5_*", 400)
    assert d.efa_devices is None and d.libfabric_provider is None
    assert d.instance_types == ()
    compute = d.ib_compute_devices
    assert isinstance(compute, tuple) and len(compute) == d.ib_devices
    assert all(str(n).startswith("mlx5_") for n in compute)
