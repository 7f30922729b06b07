"""Drain reasons: grammar, sanitising (hostile detail text), length, ownership."""

import string

from hypothesis import given, strategies as st

from gpuguard.reason import MAX_LEN, format_reason, is_ours, parse_reason, sanitize


def test_grammar_matches_design_example():
    r = format_reason("gpu.xid", "XID79", "GPU 0000:3b:00 fell off the bus", "prolog")
    assert r == "gpuguard: gpu.xid XID79: GPU 0000:3b:00 fell off the bus [prolog]"
    p = parse_reason(r)
    assert p and (p.check_id, p.keyword, p.context, p.action) == ("gpu.xid", "XID79", "prolog", "drain")


def test_action_goes_into_context():
    r = format_reason("gpu.row_remap", "ROWREMAP", "GPU 2 row remapping pending", "healthcheck", "reset")
    assert r.endswith("[healthcheck reset]")
    assert parse_reason(r).action == "reset"


def test_unknown_keyword_rejected():
    import pytest

    with pytest.raises(ValueError):
        format_reason("gpu.xid", "BOGUS", "x", "prolog")


def test_hostile_detail_is_neutralised():
    r = format_reason("gpu.nvml", "NVML", 'name="$(rm -rf /)"\n`id`; [x]=y \x07', "prolog")
    assert "\n" not in r and '"' not in r and "`" not in r and "=" not in r.split("[")[0]
    assert r.startswith("gpuguard: gpu.nvml NVML: ")
    assert r.endswith("[prolog]")


def test_long_detail_truncated_but_context_kept():
    r = format_reason("gpu.nvlink", "NVLINK", "x" * 500, "prolog", "reboot")
    assert len(r) <= MAX_LEN
    assert r.endswith("... [prolog reboot]")


@given(st.text(), st.sampled_from(["prolog", "epilog", "healthcheck", "manual"]),
       st.sampled_from(["drain", "reset", "reboot", "replace"]))
def test_any_detail_gives_a_safe_parseable_reason(detail, ctx, action):
    r = format_reason("gpu.ecc", "ECC", detail, ctx, action)
    assert len(r) <= MAX_LEN
    assert all(c in string.printable and c not in "\r\n\t\x0b\x0c\"'`\\" for c in r)
    assert is_ours(r)
    p = parse_reason(r)
    assert p is not None and p.context == ctx and p.action == action and p.keyword == "ECC"


def test_ownership():
    assert is_ours("gpuguard: gpu.xid XID79: x [prolog]")
    assert not is_ours("Prolog error")
    assert not is_ours("admin: replacing PSU gpuguard: later")
    assert not is_ours(None)
    assert sanitize("  a\t\tb  ") == "a b"
