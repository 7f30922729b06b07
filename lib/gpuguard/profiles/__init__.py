"""Instance profiles: what hardware a node of a given type must have, and its limits.

Profiles are data (`<name>.yaml` beside this file, or in a site directory). A field left out (None) means
"no expectation": the check that needs it is skipped, never guessed.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from gpuguard.config.compiled import copy_path, read_copy, source_digest, write_copy
from gpuguard.util.record import Frozen, field, field_names, record

# paths are plain strings (os.path): the hooks load a profile on every run and pathlib costs ~13M instructions to import
PROFILE_DIR = os.path.dirname(os.path.realpath(__file__))


@record
class Profile(Frozen):
    name: str
    description: str = ""
    instance_types: tuple[str, ...] = ()  # EC2 instance types this profile describes
    gpu_count: Optional[int] = None
    gpu_model: Optional[str] = None  # substring of nvmlDeviceGetName, e.g. "H100 80GB HBM3"
    gpu_memory_mib: Optional[int] = None  # total framebuffer NVML reports per GPU (MiB)
    gpu_memory_tolerance_pct: float = 2.0
    nvlinks_per_gpu: Optional[int] = None
    pcie_gen: Optional[int] = None  # expected max link generation of each GPU
    pcie_width: Optional[int] = None  # expected link width of each GPU
    gpu_temp_warn_c: Optional[int] = None
    gpu_temp_fail_c: Optional[int] = None
    efa_devices: Optional[int] = None
    ib_devices: Optional[int] = None  # InfiniBand HCAs used for the compute fabric
    ib_device_pattern: Optional[str] = None  # glob over /sys/class/infiniband names, e.g. "mlx5_*"
    # exact compute-fabric HCA names where the node also has storage/management HCAs (DGX: 8 of 10 ports)
    ib_compute_devices: tuple[str, ...] = ()
    ib_rate_gbps: Optional[int] = None
    libfabric_provider: Optional[str] = None  # "efa" where fi_info must find it
    cpus: Optional[int] = None  # online logical CPUs
    memory_gib: Optional[int] = None  # minimum MemTotal
    nccl_busbw_gbps: Optional[float] = None  # single-node all_reduce large-message busbw floor
    nvswitch: bool = False  # NVSwitch system: Fabric Manager must have registered every GPU (gpu.fabric)
    extra: dict[str, Any] = field(default_factory=dict)


PROFILE_FIELDS = field_names(Profile)  # in declaration order


class ProfileError(ValueError):
    pass


def profile_dirs(extra_dir: Optional[str] = None) -> list[str]:
    dirs = []
    if extra_dir:
        dirs.append(os.fspath(extra_dir))
    dirs.append(PROFILE_DIR)
    return dirs


def _profile_from_mapping(name: str, data: dict[str, Any], source: str) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile must be a mapping")
    kwargs: dict[str, Any] = {"name": data.get("name", name)}
    for key, value in data.items():
        if key == "name":
            continue
        if key not in PROFILE_FIELDS:
            raise ProfileError(f"{source}: unknown profile key '{key}'")
        if key in ("instance_types", "ib_compute_devices"):
            value = tuple(value or ())
        kwargs[key] = value
    return Profile(**kwargs)


def load_profile_file(path: str, cache_dir: Optional[str] = None) -> Profile:
    """The profile in `path`. With `cache_dir`, through a compiled copy kept there (gpuguard.config.compiled):
    the hooks read a profile on every run, and YAML is parsed only when the file changed."""
    path = os.fspath(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read: {e.strerror}") from None
    digest = source_digest(raw)
    copy = copy_path(cache_dir, "profile", str(path)) if cache_dir else None
    if copy is not None:
        value = read_copy(copy, digest)
        if isinstance(value, dict):
            try:
                return _profile_from_mapping(stem, value, path)
            except (ProfileError, TypeError):
                pass  # a copy from another version: compile again
    from gpuguard.config.yamlutil import load_yaml_text  # cold path: the file is new or changed

    data = load_yaml_text(raw, path) or {}
    profile = _profile_from_mapping(stem, data, path)
    if copy is not None:
        write_copy(copy, digest, profile_to_dict(profile), path)
    return profile


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """Every field (a compiled copy of a profile: tuples become lists, _profile_from_mapping turns them back)."""
    return {name: list(v) if isinstance(v, tuple) else v for name in PROFILE_FIELDS
            for v in (getattr(profile, name),)}


def find_profile_file(name: str, extra_dir: Optional[str] = None) -> Optional[str]:
    """`<name>.yaml` in the site directory, else among the built-in profiles; None when no file has that name."""
    for d in profile_dirs(extra_dir):
        p = os.path.join(d, f"{name}.yaml")
        if os.path.isfile(p):
            return p
    return None


def list_profiles(extra_dir: Optional[str] = None) -> dict[str, str]:
    """Profile name -> file, the site directory's winning over the built-in ones."""
    found: dict[str, str] = {}
    for d in reversed(profile_dirs(extra_dir)):  # site directory wins
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".yaml"))
        except OSError:  # not there, or not a directory
            continue
        for n in names:
            found[n[:-len(".yaml")]] = os.path.join(d, n)
    return found


def load_profile(name: str, extra_dir: Optional[str] = None, cache_dir: Optional[str] = None) -> Profile:
    """Load a profile by name or by EC2 instance type (file names are the instance types). `cache_dir`: keep a
    compiled copy there (see load_profile_file)."""
    path = find_profile_file(name, extra_dir)
    if path is not None:
        return load_profile_file(path, cache_dir)
    # fall back to a profile that lists the instance type
    for path in list_profiles(extra_dir).values():
        prof = load_profile_file(path)
        if name in prof.instance_types:
            return prof
    known = ", ".join(sorted(list_profiles(extra_dir)))
    raise ProfileError(f"no profile named '{name}' (known: {known})")


def apply_overrides(profile: Profile, overrides: dict[str, Any]) -> Profile:
    if not overrides:
        return profile
    data = {f: getattr(profile, f) for f in PROFILE_FIELDS}
    for k, v in overrides.items():
        if k not in PROFILE_FIELDS or k == "name":
            raise ProfileError(f"unknown profile key '{k}'")
        data[k] = v
    return Profile(**data)


def is_valid_profile_name(name: str) -> bool:
    return bool(name) and os.sep not in name and not name.startswith(".")
