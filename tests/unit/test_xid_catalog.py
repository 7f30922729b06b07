"""The Xid catalog: data validity, the severity contract the prolog relies on, overrides, explain, unknown codes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml


from gpuguard.xid import catalog as xid  # noqa: E402
from gpuguard.xid.catalog import (ACTIONS, CAUSES, SEVERITIES, XidCatalog, XidCatalogError, XidInfo,  # noqa: E402
                          explain, load_catalog)

RAW = yaml.load(xid.CATALOG_PATH.read_bytes(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
BUCKETS = RAW["buckets"]

# Codes the catalog must document (the brief's list, plus 144-150).
REQUIRED = [8, 13, 31, 32, 38, 43, 44, 45, 48, 56, 57, 58, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 110, 119,
            120, 121, 122, 123, 136, 140, 143, *range(144, 151), 154, 155]


@pytest.fixture(scope="module")
def cat() -> XidCatalog:
    return load_catalog()


# --------------------------------------------------------------------------- the data


def test_catalog_covers_every_code_nvidia_lists(cat: XidCatalog) -> None:
    assert cat.codes() == list(range(1, 173))  # NVIDIA's catalog lists 1..172
    for code in REQUIRED:
        assert code in cat, code


def test_every_entry_has_valid_fields(cat: XidCatalog) -> None:
    for code in cat.codes():
        info = cat.lookup(code)
        assert info.code == code
        assert info.source == "catalog"
        assert info.name.strip() and info.description.strip() and info.nvidia_action_text.strip(), code
        assert info.mnemonic and info.mnemonic == info.mnemonic.upper(), code
        assert info.severity in SEVERITIES, code
        assert info.action in ACTIONS, code
        assert set(info.causes) <= set(CAUSES) and len(set(info.causes)) == len(info.causes), code
        assert info.nvidia_action == "" or info.nvidia_action in BUCKETS, code
        # the contract: fatal <=> the node is taken out of service
        assert (info.severity == "fatal") == (info.action != "none"), code
        assert info.is_fatal == cat.is_fatal(code) == (info.severity == "fatal")


def test_departures_from_nvidias_bucket_are_explained(cat: XidCatalog) -> None:
    """Every judgement call carries a note: no bucket, or severity/action other than the bucket's default."""
    unexplained = []
    for code in cat.codes():
        info = cat.lookup(code)
        bucket = BUCKETS.get(info.nvidia_action)
        default = bucket is not None and info.action == bucket["action"] and info.severity in bucket["severities"]
        if not default and not info.note:
            unexplained.append(code)
    assert unexplained == []


def test_buckets_map_as_the_brief_says() -> None:
    assert BUCKETS["RESTART_APP"]["action"] == "none"
    assert BUCKETS["RESET_GPU"]["action"] == "reset"
    assert BUCKETS["RESTART_BM"]["action"] == "reboot"
    assert BUCKETS["CONTACT_SUPPORT"]["action"] == "replace"
    assert BUCKETS["CHECK_MECHANICALS"]["action"] == "replace"
    assert BUCKETS["IGNORE"]["action"] == "none"


def test_nvidia_tokens_are_verbatim(cat: XidCatalog) -> None:
    expected = {8: "RESTART_APP", 13: "RESTART_APP", 45: "WORKFLOW_XID_45", 48: "WORKFLOW_XID_48", 54: "CHECK_MECHANICALS",
                63: "IGNORE", 64: "RESET_GPU", 74: "WORKFLOW_NVLINK_ERR", 79: "RESTART_BM", 92: "IGNORE",
                94: "RESTART_APP", 95: "RESET_GPU", 119: "RESET_GPU", 140: "RESET_GPU", 144: "WORKFLOW_NVLINK5_ERR",
                151: "RESTART_VM", 154: "XID_154", 159: "CHECK_UVM", 162: ""}
    assert {c: cat.lookup(c).nvidia_action for c in expected} == expected
    assert cat.lookup(79).mnemonic == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert cat.lookup(79).name == "GPU has fallen off the bus"
    assert cat.lookup(95).nvidia_investigatory == "IGNORE (sympathetic)"


# --------------------------------------------------------------------------- the severity contract


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_application_faults_are_attributed_to_the_job(cat: XidCatalog, code: int) -> None:
    info = cat.lookup(code)
    assert info.severity == "app" and info.action == "none"
    assert not cat.is_fatal(code)


@pytest.mark.parametrize("code,action", [(48, "reset"), (74, "reset"), (79, "reboot"), (95, "reset"), (119, "reset"),
                                         (120, "reset"), (140, "reset"), (64, "reset"), (62, "reset"), (54, "replace"),
                                         (92, "drain"), (154, "reboot"), (149, "reset"), (56, "replace")])
def test_node_fatal_xids(cat: XidCatalog, code: int, action: str) -> None:
    info = cat.lookup(code)
    assert info.severity == "fatal" and cat.is_fatal(code)
    assert info.action == action


@pytest.mark.parametrize("code,severity", [(94, "warn"), (63, "warn"), (32, "warn"), (121, "warn"), (147, "warn"),
                                           (14, "info"), (106, "info"), (8, "app"), (68, "app")])
def test_node_stays_in_service(cat: XidCatalog, code: int, severity: str) -> None:
    info = cat.lookup(code)
    assert (info.severity, info.action) == (severity, "none")


def test_judgement_calls_are_justified_in_notes(cat: XidCatalog) -> None:
    for code in (32, 43, 45, 63, 74, 92, 94, 154, 159):
        assert len(cat.lookup(code).note) > 40, code


# --------------------------------------------------------------------------- unknown codes


def test_unknown_code_warns_and_never_drains(cat: XidCatalog) -> None:
    """A driver upgrade that adds an informational code must not drain every node of the fleet at once."""
    info = cat.lookup(4242)
    assert info.code == 4242 and "4242" in info.name
    assert (info.severity, info.action, info.source) == ("warn", "none", "unknown")
    assert not cat.is_fatal(4242)
    assert 4242 not in cat


def test_unknown_is_overridable() -> None:
    cat = load_catalog({"unknown": {"severity": "fatal"}})
    assert (cat.lookup(4242).severity, cat.lookup(4242).action) == ("fatal", "drain")
    assert cat.is_fatal(4242)
    assert cat.lookup(13).severity == "app"  # known codes untouched


# --------------------------------------------------------------------------- NVLink5 (Blackwell) Xids 144-150
# Real kernel messages: NVIDIA/TensorRT-LLM#4816 (B200 HGX) and leptonai/gpud#1174 (GB200), see
# tests/fixtures/kernel_log/README.md.
NVLINK5_LINES = [
    ("145, RLW_REMAP Nonfatal XC0 i0 Link 02", 145, "warn"),
    ("145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00000000 0x00000000)",
     145, "warn"),
    ("149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
     149, "fatal"),
    ("149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)", 149,
     "fatal"),
    ("149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", 149, "warn"),
    ("144, SAW_MVB Fatal XC0 i0 Link 00 (0x00000001 0x00000002 0x00000000 0x00000000)", 144, "fatal"),
    ("147, TREX Fatal XC0 i0 Link 05 (0x00000001 0x00000000 0x00000000 0x00000000)", 147, "fatal"),
]


@pytest.mark.parametrize("line,code,severity", NVLINK5_LINES)
def test_nvlink5_fatal_token_decides(cat: XidCatalog, line: str, code: int, severity: str) -> None:
    detail = line.split(",", 1)[1]
    info = cat.resolve(code, detail)
    assert info.severity == severity, info.note
    assert info.action == ("reset" if severity == "fatal" else "none")
    assert ("Nonfatal" if severity == "warn" else "Fatal") in info.note


def test_nvlink5_without_token_keeps_the_catalog_entry(cat: XidCatalog) -> None:
    assert cat.resolve(149, " something new").severity == cat.lookup(149).severity == "fatal"
    assert cat.resolve(148, " NVLPW_CTRL").severity == "warn"


def test_nvlink5_site_override_wins(cat: XidCatalog) -> None:
    over = load_catalog({145: {"severity": "fatal", "action": "reboot"}})
    assert over.resolve(145, " RLW_REMAP Nonfatal XC0 i0 Link 02").severity == "fatal"


def test_xid149_note_is_not_all_fatal(cat: XidCatalog) -> None:
    assert "Nonfatal" in cat.lookup(149).note and "every listed NETIR subcode" not in cat.lookup(149).note


# --------------------------------------------------------------------------- overrides


def test_raising_severity_drains_and_leaves_the_base_catalog_alone(cat: XidCatalog) -> None:
    over = load_catalog({94: {"severity": "fatal"}})
    info = over.lookup(94)
    assert (info.severity, info.action, info.source) == ("fatal", "drain", "override")
    assert over.is_fatal(94)
    assert load_catalog().lookup(94).severity == "warn"  # cached base not mutated
    assert cat.lookup(94).severity == "warn"


def test_override_variants() -> None:
    cat = load_catalog({79: {"action": "replace", "note": "our PCIe risers"},
                        48: {"severity": "warn"},
                        "13": {"action": "reset"},  # string keys (JSON configs) are accepted
                        92: {"action": "none"},
                        173: {"name": "Something new", "severity": "warn"}})
    assert (cat.lookup(79).severity, cat.lookup(79).action, cat.lookup(79).note) == ("fatal", "replace", "our PCIe risers")
    assert (cat.lookup(48).severity, cat.lookup(48).action) == ("warn", "none")
    assert (cat.lookup(13).severity, cat.lookup(13).action) == ("fatal", "reset")
    assert (cat.lookup(92).severity, cat.lookup(92).action) == ("warn", "none")
    new = cat.lookup(173)
    assert (new.name, new.severity, new.action, new.source) == ("Something new", "warn", "none", "override")
    assert 173 in cat


@pytest.mark.parametrize("overrides,words", [
    ({94: {"severty": "fatal"}}, ["94", "severty", "allowed"]),
    ({94: {"severity": "fatl"}}, ["94", "severity", "fatl", "fatal, app, warn, info"]),
    ({79: {"action": "nuke"}}, ["79", "action", "nuke"]),
    ({79: {"severity": "fatal", "action": "none"}}, ["79", "fatal", "none"]),
    ({13: {"severity": "app", "action": "reboot"}}, ["13", "reboot", "severity"]),
    ({"abc": {"severity": "warn"}}, ["abc", "Xid codes"]),
    ({0: {"severity": "warn"}}, ["0", "positive"]),
    ({True: {"severity": "warn"}}, ["True"]),
    ({94: "fatal"}, ["94", "mapping"]),
    ({94: {"note": 5}}, ["94", "note", "string"]),
    ({"unknown": {"action": "sometimes"}}, ["unknown", "action", "sometimes"]),
])
def test_bad_overrides_are_named(overrides: dict, words: list[str]) -> None:
    with pytest.raises(XidCatalogError) as e:
        load_catalog(overrides)
    assert isinstance(e.value, ValueError)  # config.py catches ValueError
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_overrides_must_be_a_mapping() -> None:
    with pytest.raises(XidCatalogError, match="mapping"):
        load_catalog([94])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- Xid 154 and resolve


@pytest.mark.parametrize("detail,action,severity", [
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", "reboot", "fatal"),
    ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", "reset", "fatal"),
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", "reset", "fatal"),
    ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", "drain", "fatal"),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "none", "info"),
    ("GPU recovery action changed from 0x0 to 0x2", "reboot", "fatal"),  # no label: nvml value
])
def test_xid154_uses_the_action_in_the_message(cat: XidCatalog, detail: str, action: str, severity: str) -> None:
    info = cat.resolve(154, detail)
    assert (info.action, info.severity) == (action, severity)


def test_xid154_without_a_parseable_message_fails_closed(cat: XidCatalog) -> None:
    assert cat.resolve(154, "something else entirely").action == "reboot"
    assert cat.resolve(154).action == "reboot"
    assert cat.resolve(79, "to 0x0 (None)") == cat.lookup(79)  # only 154 reads the message


def test_site_override_of_154_wins_over_the_message() -> None:
    cat = load_catalog({154: {"severity": "warn"}})
    assert cat.resolve(154, "changed from 0x0 (None) to 0x2 (Node Reboot Required)").severity == "warn"


# --------------------------------------------------------------------------- explain


def test_explain_names_the_xid_and_what_happens(cat: XidCatalog) -> None:
    text = explain(79)
    assert "Xid 79: GPU has fallen off the bus" in text
    assert "reboot" in text and "RESTART_BM" in text and "fatal" in text
    assert "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html" in text
    assert len(text.splitlines()) >= 6
    assert all(len(line) <= 100 or "https://" in line for line in text.splitlines())


def test_explain_says_when_site_config_changed_it() -> None:
    cat = load_catalog({94: {"severity": "fatal", "note": "we drain on contained errors"}})
    text = cat.explain(94)
    assert "Contained memory error" in text and "drain" in text and "site config" in text
    assert "we drain on contained errors" in text


def test_explain_unknown_code(cat: XidCatalog) -> None:
    text = cat.explain(4242)
    assert "Xid 4242" in text and "missing from its catalog" in text and "drain" in text


def test_explain_every_code(cat: XidCatalog) -> None:
    for code in cat.codes():
        info = cat.lookup(code)
        text = cat.explain(code)
        assert f"Xid {code}: {info.name}" in text and info.action in text


# --------------------------------------------------------------------------- loading


def test_generated_module_matches_the_yaml() -> None:
    from gpuguard.xid import catalog_data as generated

    stale = "xid/xid_catalog.yaml changed: run `PYTHONPATH=lib python -m gpuguard.xid.catalog regen`"
    assert generated.YAML_FINGERPRINT == xid._fingerprint(xid.CATALOG_PATH.read_bytes()), stale
    assert generated.DATA == RAW, stale


def test_default_load_uses_the_generated_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prolog path must not parse 90 KB of YAML (about 9 ms) on every job."""
    def no_parse(blob: bytes, source: str) -> None:
        raise AssertionError("parsed the YAML although the generated data is current")

    monkeypatch.setattr(xid, "_BASE_CACHE", {})
    monkeypatch.setattr(xid, "_parse_yaml", no_parse)
    assert len(load_catalog()) == 172


def test_an_edited_yaml_is_parsed_not_shadowed(tmp_path: Path) -> None:
    text = xid.CATALOG_PATH.read_text(encoding="utf-8")
    marker = '    name: "GPU has fallen off the bus"'
    assert marker in text
    p = tmp_path / "xid_catalog.yaml"
    p.write_text(text.replace(marker, '    name: "GPU gone (edited)"'), encoding="utf-8")
    assert load_catalog(path=p).lookup(79).name == "GPU gone (edited)"


def _catalog_with(tmp_path: Path, old: str, new: str) -> Path:
    text = xid.CATALOG_PATH.read_text(encoding="utf-8")
    assert old in text
    p = tmp_path / "bad.yaml"
    p.write_text(text.replace(old, new, 1), encoding="utf-8")
    return p


@pytest.mark.parametrize("old,new,words", [
    ("  79:\n    mnemonic", "  79:\n    colour: red\n    mnemonic", ["xids.79", "colour"]),
    ("    severity: fatal\n    action: reboot\n    causes: [hw, driver, system_memory, bus, thermal]",
     "    severity: fatl\n    action: reboot\n    causes: [hw, driver, system_memory, bus, thermal]",
     ["xids.79", "severity", "fatl"]),
    ("    severity: fatal\n    action: reboot\n    causes: [hw, driver, system_memory, bus, thermal]",
     "    severity: fatal\n    action: none\n    causes: [hw, driver, system_memory, bus, thermal]",
     ["xids.79", "fatal", "none"]),
    ("causes: [hw, driver, system_memory, bus, thermal]", "causes: [hw, gremlins]", ["xids.79", "causes", "gremlins"]),
    ('    nvidia_action: "RESTART_BM"', '    nvidia_action: "RESTART_EVERYTHING"', ["xids.79", "RESTART_EVERYTHING"]),
    ("version: 1", "version: 2", ["version"]),
])
def test_bad_catalog_files_are_named(tmp_path: Path, old: str, new: str, words: list[str]) -> None:
    with pytest.raises(XidCatalogError) as e:
        load_catalog(path=_catalog_with(tmp_path, old, new))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_unreadable_catalog(tmp_path: Path) -> None:
    with pytest.raises(XidCatalogError, match="cannot read"):
        load_catalog(path=tmp_path / "missing.yaml")


def test_entries_are_immutable(cat: XidCatalog) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        cat.lookup(79).severity = "info"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cat.entries[79] = cat.lookup(13)  # type: ignore[index]
    assert isinstance(cat.lookup(79), XidInfo)
