"""The Xid catalog: what an NVIDIA Xid means and what gpuguard does about it on the node.

The data lives in `xid_catalog.yaml` (built from NVIDIA's Xid catalog, sources in its header); this module
only loads, validates and queries it. Sites adjust entries with overrides from their config
(`xid: {overrides: {94: {severity: fatal}}}`), never by editing the file.

Loading is on the prolog's path (every job), so it must be cheap. Parsing the 90 KB YAML with libyaml takes about
9 ms, so the parsed data is also shipped as a generated module (`catalog_data.py`, about 0.4 ms to import from
its .pyc) stamped with the size and CRC-32 of the YAML it came from. `load_catalog` reads and checksums the YAML
(0.1 ms) and uses the generated data only when both match, so the YAML stays the single source of truth: an edited
YAML is parsed, never silently ignored. (CRC-32, not SHA-256: this detects staleness, not tampering, and importing
hashlib alone costs 2 ms.) Regenerate after editing the YAML with `python -m gpuguard.xid.catalog regen`; a unit test fails
until you do.

An entry and the catalog's queries are in gpuguard.xid.entries, validation in gpuguard.xid.validate, site
overrides in gpuguard.xid.overrides.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from gpuguard.xid.entries import (ACTIONS, CAUSES, NVLINK5_CODES, OVERRIDE_KEYS, SEVERITIES, XidCatalog,
                                  XidCatalogError, XidInfo, decode_nvlink5)
from gpuguard.xid.overrides import apply_overrides
from gpuguard.xid.validate import build_catalog

# The catalog's public face: the hooks' checks import these names from here (defined in gpuguard.xid.entries).
__all__ = ["ACTIONS", "CAUSES", "NVLINK5_CODES", "OVERRIDE_KEYS", "SEVERITIES", "XidCatalog", "XidCatalogError",
           "XidInfo", "apply_overrides", "decode_nvlink5", "explain", "load_catalog"]

CATALOG_PATH = Path(__file__).resolve().parent / "xid_catalog.yaml"
GENERATED_PATH = Path(__file__).resolve().parent / "catalog_data.py"


# --------------------------------------------------------------------------- loading


def load_catalog(overrides: Optional[Mapping[Any, Mapping[str, Any]]] = None,
                 path: Union[str, Path, None] = None) -> XidCatalog:
    """The catalog at `path` (default: the shipped one) with site `overrides` applied.

    `overrides` maps an Xid code (int, or a string of digits) or "unknown" to a mapping of OVERRIDE_KEYS, e.g.
    `{94: {"severity": "fatal"}, "unknown": {"severity": "warn"}}`. Severity and action stay coherent: raising a
    code to fatal without naming an action drains (`drain`); lowering it below fatal without naming one sets
    `none`. An override for a code the catalog lacks adds it. Raises XidCatalogError naming the code and key.
    """
    base = _load_base(Path(path) if path is not None else CATALOG_PATH)
    if not overrides:
        return base
    return apply_overrides(base, overrides)


_BASE_CACHE: dict[tuple[str, str], XidCatalog] = {}


def _load_base(path: Path) -> XidCatalog:
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise XidCatalogError(f"{path}: cannot read the Xid catalog: {e.strerror}") from None
    digest = _fingerprint(blob)
    key = (str(path), digest)
    cached = _BASE_CACHE.get(key)
    if cached is None:
        cached = build_catalog(_raw_data(blob, digest, str(path)), str(path))
        _BASE_CACHE[key] = cached
    return cached


def _raw_data(blob: bytes, digest: str, source: str) -> Any:
    try:  # generated data (1,800 lines): imported only here, where it is used
        from gpuguard.xid import catalog_data as generated
    except ImportError:  # pragma: no cover - a checkout without the generated module
        generated = None
    if generated is not None and getattr(generated, "YAML_FINGERPRINT", None) == digest:
        return generated.DATA
    return _parse_yaml(blob, source)


def _fingerprint(blob: bytes) -> str:
    return f"{len(blob)}:{zlib.crc32(blob):08x}"


def _parse_yaml(blob: bytes, source: str) -> Any:
    import yaml  # only for a YAML the generated data does not match (or regen): ~15 ms off the prolog's path

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(blob, Loader=loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise XidCatalogError(f"{source}: {where}{getattr(e, 'problem', None) or e}") from None


# --------------------------------------------------------------------------- explain


def explain(code: int, catalog: Optional[XidCatalog] = None) -> str:
    """Multi-line human text about one Xid, from `catalog` (default: the shipped catalog, no overrides)."""
    return (catalog or load_catalog()).explain(code)


# --------------------------------------------------------------------------- generated module


def generated_module_source(path: Union[str, Path, None] = None) -> str:
    """Python source of `catalog_data.py` for the YAML at `path` (validated first)."""
    import pprint  # only `regen` needs it

    p = Path(path) if path is not None else CATALOG_PATH
    blob = p.read_bytes()
    data = _parse_yaml(blob, str(p))
    build_catalog(data, str(p))  # never ship data the loader would reject
    return ("# Generated from xid_catalog.yaml by `python -m gpuguard.xid.catalog regen`. Do not edit: edit the YAML.\n"
            "# The loader uses DATA only while YAML_FINGERPRINT (size:crc32) matches the YAML, else parses the YAML.\n"
            "# flake8: noqa\n"
            f"YAML_FINGERPRINT = {_fingerprint(blob)!r}\n"
            f"DATA = {pprint.pformat(data, width=118, sort_dicts=False)}\n")


def _main(argv: list[str]) -> int:
    if argv[:1] == ["regen"]:
        GENERATED_PATH.write_text(generated_module_source(), encoding="utf-8")
        print(f"wrote {GENERATED_PATH}")
        return 0
    if len(argv) == 2 and argv[0] == "explain" and argv[1].isdigit():
        print(explain(int(argv[1])))
        return 0
    print("usage: python -m gpuguard.xid.catalog regen | explain CODE", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main(sys.argv[1:]))
