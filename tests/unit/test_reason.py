"""Drain reasons: grammar (keyword first, for `sinfo -R`), sanitising (hostile detail text, while ordinary punctuation
such as the apostrophe in "the GPU's slowdown temperature" stays), length, ownership, and the old grammar
(`<check-id> <KEYWORD>:`) still recognised so a fleet being upgraded keeps undraining."""

import re
import string

import pytest
from hypothesis import given, strategies as st

from gpuguard.pipeline.policy import decide_undrain
from gpuguard.slurm.reason import KEYWORDS, MAX_LEN, format_reason, is_ours, parse_reason, sanitize

CONTEXTS = ["prolog", "epilog", "healthcheck", "manual", "watch", "sweep"]
ACTIONS = ["drain", "reset", "reboot", "replace"]


def test_grammar_puts_the_keyword_first():
    r = format_reason("gpu.xid", "XID79", "GPU has fallen off the bus on 0000:86:00", "prolog", "reboot")
    assert r == "gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot]"
    p = parse_reason(r)
    assert p and (p.check_id, p.keyword, p.detail, p.context, p.action, p.legacy) == (
        "gpu.xid", "XID79", "GPU has fallen off the bus on 0000:86:00", "prolog", "reboot", False)


@pytest.mark.parametrize("keyword", sorted(KEYWORDS) + ["XID119"])
def test_sinfo_R_shows_the_keyword(keyword):
    """`sinfo -R` prints the reason in a 20-character column: the keyword must be in it, whatever the check."""
    r = format_reason("fabric.efa_counters", keyword, "whatever went wrong", "healthcheck")
    assert r[:20].startswith(f"gpuguard: {keyword}")


def test_action_goes_into_context():
    r = format_reason("gpu.row_remap", "ROWREMAP", "GPU 2 row remapping pending", "healthcheck", "reset")
    assert r.endswith("[healthcheck reset]")
    assert parse_reason(r).action == "reset"


def test_unknown_keyword_rejected():
    with pytest.raises(ValueError):
        format_reason("gpu.xid", "BOGUS", "x", "prolog")


def test_hostile_detail_is_neutralised():
    r = format_reason("gpu.nvml", "NVML", 'name="$(rm -rf /)"\n`id`; [x]=y \x07', "prolog")
    assert "\n" not in r and '"' not in r and "`" not in r and "=" not in r
    assert r.startswith("gpuguard: NVML gpu.nvml: ")
    assert r.endswith("[prolog]")


def test_long_detail_truncated_but_context_kept():
    r = format_reason("gpu.nvlink", "NVLINK", "x" * 500, "prolog", "reboot")
    assert len(r) <= MAX_LEN
    assert r.endswith("... [prolog reboot]")


_STRAY_QUOTE = re.compile(r"(?<![A-Za-z0-9])'|'(?![A-Za-z0-9])")


def _clean_text(t: str) -> bool:
    """Single line, printable, no double quote/backquote/backslash/'='/brackets, an apostrophe only inside a word."""
    return (all(c in string.printable and c not in "\r\n\t\x0b\x0c\"`\\=[]" for c in t)
            and not _STRAY_QUOTE.search(t))


def _safe(r: str) -> bool:
    """A whole reason: short, and brackets only around the context at the end."""
    head, sep, tail = r.rpartition(" [")
    return (len(r) <= MAX_LEN and bool(sep) and tail.endswith("]") and _clean_text(head)
            and _clean_text(tail[:-1]))


def test_apostrophe_inside_a_word_is_kept():
    r = format_reason("gpu.temperature", "THERMAL", "GPU 6 (0000:b9:00.0) at 91C (limit 89C, the GPU's slowdown "
                      "temperature)", "healthcheck")
    assert r == ("gpuguard: THERMAL gpu.temperature: GPU 6 (0000:b9:00.0) at 91C (limit 89C, the GPU's slowdown "
                 "temperature) [healthcheck]")
    assert parse_reason(r).detail.endswith("the GPU's slowdown temperature)")
    # quotes that are not an apostrophe inside a word still go, as do the other unsafe characters
    assert sanitize("name='x' it's \"y\" a ' b 'c x'=y") == "name x it's y a b c x y"
    assert sanitize("don`'t") == "don t"


@given(st.text())
def test_sanitize_output_is_always_clean_and_stable(text):
    out = sanitize(text)
    assert _clean_text(out) and out == out.strip() and "  " not in out
    assert sanitize(out) == out


@given(st.lists(st.from_regex(r"[A-Za-z0-9]{1,8}('[A-Za-z0-9]{1,4})?", fullmatch=True), min_size=1, max_size=8))
def test_words_with_apostrophes_survive(words):
    text = " ".join(words)
    assert sanitize(text) == text


@given(st.from_regex(r"[A-Za-z ]{60,120}'[a-z]{1,3}[A-Za-z ]{0,40}", fullmatch=True))
def test_truncation_never_leaves_a_dangling_apostrophe(detail):
    r = format_reason("gpu.temperature", "THERMAL", detail, "healthcheck", "drain")
    assert _safe(r), r


@given(st.text(), st.sampled_from(sorted(KEYWORDS)), st.sampled_from(CONTEXTS), st.sampled_from(ACTIONS),
       st.from_regex(r"[A-Za-z0-9_. -]{0,30}", fullmatch=True))
def test_any_detail_gives_a_safe_parseable_reason(detail, keyword, ctx, action, check_id):
    r = format_reason(check_id, keyword, detail, ctx, action)
    assert _safe(r)
    assert is_ours(r)
    p = parse_reason(r)
    assert p is not None and not p.legacy
    assert (p.keyword, p.context, p.action) == (keyword, ctx, action)
    assert p.check_id == (check_id.lower().replace(" ", "_").replace("-", "_") or "unknown")
    clean = sanitize(detail) or "failed"
    assert p.detail == clean or (p.detail.endswith("...") and clean.startswith(p.detail[:-3]))


# --------------------------------------------------------------------------- the old grammar


LEGACY_EXAMPLES = [
    ("gpuguard: gpu.xid XID79: GPU 0000:3b:00 fell off the bus [prolog]",
     ("gpu.xid", "XID79", "GPU 0000:3b:00 fell off the bus", "prolog", "drain")),
    ("gpuguard: gpu.xid XID79: GPU has fallen off the bus on 0000:86:00 [watch reboot]",
     ("gpu.xid", "XID79", "GPU has fallen off the bus on 0000:86:00", "watch", "reboot")),
    ("gpuguard: gpu.row_remap ROWREMAP: GPU 2 (0000:75:00.0): row remapping pending [healthcheck reset]",
     ("gpu.row_remap", "ROWREMAP", "GPU 2 (0000:75:00.0): row remapping pending", "healthcheck", "reset")),
    ("gpuguard: gpu.xid FLAPPING: drained again after 3 undrains in 24h: x [healthcheck replace]",
     ("gpu.xid", "FLAPPING", "drained again after 3 undrains in 24h: x", "healthcheck", "replace")),
    ("gpuguard: gpuguard INTERNAL: KeyError: gpus [prolog]",
     ("gpuguard", "INTERNAL", "KeyError: gpus", "prolog", "drain")),
]


@pytest.mark.parametrize("reason,fields", LEGACY_EXAMPLES, ids=[e[1][1] + "-" + e[1][3] for e in LEGACY_EXAMPLES])
def test_old_grammar_is_still_parsed_and_ours(reason, fields):
    assert is_ours(reason)
    p = parse_reason(reason)
    assert p is not None and p.legacy
    assert (p.check_id, p.keyword, p.detail, p.context, p.action) == fields


legacy_reasons = st.builds(
    lambda cid, kw, n, detail, ctx, action: (
        f"gpuguard: {cid} {kw}{n}: {sanitize(detail) or 'failed'} [{ctx}{'' if action == 'drain' else ' ' + action}]",
        (cid, f"{kw}{n}", sanitize(detail) or "failed", ctx, action)),
    st.from_regex(r"[a-z][a-z0-9_]{0,12}(\.[a-z0-9_]{1,16})?", fullmatch=True),
    st.sampled_from(sorted(KEYWORDS)), st.sampled_from(["", "79", "48", "119"]), st.text(max_size=80),
    st.sampled_from(CONTEXTS), st.sampled_from(ACTIONS))


@given(legacy_reasons)
def test_any_old_format_reason_parses_back(case):
    reason, fields = case
    assert is_ours(reason)
    p = parse_reason(reason)
    assert p is not None and p.legacy
    assert (p.check_id, p.keyword, p.detail, p.context, p.action) == fields


def _undrain(reason: str, action: str, **kw):
    base = dict(drain_action=action, node_drained=True, node_reason=reason, node_down=False, node_maintenance=False,
                verdict="pass", passes=2, required_passes=2, boot_changed=True, undrains_in_window=0, max_undrains=3,
                undrain_replace=False)
    base.update(kw)
    return decide_undrain(**base).action


@given(legacy_reasons, st.booleans(), st.integers(0, 3), st.sampled_from(["pass", "warn", "drain"]))
def test_old_and_new_grammar_get_the_same_undrain_decision(case, boot_changed, passes, verdict):
    """A node drained by an older gpuguard is lifted (or kept) exactly as if the new one had drained it."""
    reason, (cid, kw, detail, ctx, action) = case
    new = format_reason(cid, kw, detail, ctx, action)
    kw_args = dict(boot_changed=boot_changed, passes=passes, verdict=verdict)
    assert _undrain(reason, action, **kw_args) == _undrain(new, action, **kw_args)
    assert _undrain(reason, action, **kw_args) != "closed"  # still ours: never handed over to "an admin owns it"


def test_old_format_flapping_stays_drained():
    old = "gpuguard: gpu.xid FLAPPING: drained again after 3 undrains in 24h [healthcheck replace]"
    assert _undrain(old, "replace", undrain_replace=True) == "flapping"
    assert _undrain(format_reason("gpu.xid", "FLAPPING", "drained again", "healthcheck", "replace"), "replace",
                    undrain_replace=True) == "flapping"


@given(st.text(max_size=200))
def test_parse_never_crashes_and_only_accepts_our_prefix(text):
    p = parse_reason(text)
    if p is not None:
        assert is_ours(text)
    assert parse_reason("gpuguard: " + text) is None or is_ours("gpuguard: " + text)


def test_ownership():
    assert is_ours("gpuguard: XID79 gpu.xid: x [prolog]")
    assert is_ours("gpuguard: gpu.xid XID79: x [prolog]")  # an older gpuguard's drain is still ours
    assert not is_ours("Prolog error")
    assert not is_ours("admin: replacing PSU gpuguard: later")
    assert not is_ours("")
    assert not is_ours(None)
    assert parse_reason("admin: gpu.xid XID79: x [prolog]") is None
    assert sanitize("  a\t\tb  ") == "a b"


def test_escalation_counts_drains_in_either_grammar(tmp_path):
    """A reboot-class fault back after reboots escalates to replace: the store must find earlier drains for the
    same keyword whether an older gpuguard (check id first) or this one (keyword first) wrote them."""
    import time

    from gpuguard.store.sqlite import Store

    old = "gpuguard: gpu.xid XID79: GPU has fallen off the bus on 0000:86:00 [prolog reboot]"
    new = format_reason("gpu.xid", "XID79", "GPU has fallen off the bus on 0000:86:00", "healthcheck", "reboot")
    other = format_reason("gpu.xid", "XID48", "double-bit ECC error", "prolog", "reboot")
    with Store(str(tmp_path / "n1.db")) as st:
        for boot, reason in (("boot-1", old), ("boot-2", new), ("boot-3", other)):
            run_id = st.record_run(started=time.time() - 60, duration_ms=1, node="n1", kind="prolog", job_id="1",
                                   profile=None, verdict="drain", action="reboot", reason=reason, exit_code=1,
                                   error=None, boot_id=boot, findings=[])
            st.record_drain(node="n1", op="drain", outcome="done", reason=reason, check_id="gpu.xid",
                            action="reboot", run_id=run_id, ts=time.time() - 60)
        assert st.previous_fault_boots("n1", "gpu.xid", "XID79", "boot-9", 0) == 2
        assert st.previous_fault_boots("n1", "gpu.xid", "XID48", "boot-9", 0) == 1
        assert st.previous_fault_boots("n1", "gpu.xid", "XID7", "boot-9", 0) == 0
