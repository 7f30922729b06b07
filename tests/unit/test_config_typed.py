"""Typed config (issue 15): one frozen dataclass per section, a feature's declared in gpuguard/config/sections/ (the
config package sits below every feature: issue 30), loaded and validated in one
place (gpuguard.config.schema / .parse), with the YAML format, every key, default and message of the schema it
replaced (tests/fixtures/config: recorded from the code before)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.config.checks import PARAM_VALIDATORS
from gpuguard.config.fields import validator_of
from gpuguard.config.lastgood import cache_path
from gpuguard.siteconfig import load_guarded
from gpuguard.config.parse import removed_keys
from gpuguard.config.schema import SECTIONS, ConfigError, default_config
from gpuguard.siteconfig import parse_config
from gpuguard.util.record import field_names

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "config"
BEFORE = json.loads((FIXTURES / "schema-before-typed-config.json").read_text())
REPO = Path(__file__).resolve().parents[2]

# the probe values the fixture's answers were recorded for (its "probes" are their reprs)
PROBES = ["soon", "", "auto", "/abs/path", -1, 0, 1, 4, 2.5, 1e12, float("nan"), None, True, False, [], ["a", "b"],
          [1, 2], {}, {"a": 1}, "postgresql://gg@db/fleet", "http://am.example:9093", ["http://am:9093"],
          ["json://hook.example/x"], ["ftp://x"], "pmix", "minor", "drain", "info", "boot"]


def _answers(validator):
    out = []
    for p in PROBES:
        try:
            out.append({"ok": validator(p)})
        except ValueError as e:
            out.append({"error": str(e)})
    return json.loads(json.dumps(out, default=repr))


def test_every_section_of_the_file_is_a_frozen_dataclass_attribute_of_config():
    cfg = default_config()
    assert list(SECTIONS) == list(BEFORE["sections"]), "the same sections, in the documented order"
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        assert type(section) is cls and dataclasses.is_dataclass(section)
        assert field_names(cls) == tuple(f.name for f in dataclasses.fields(cls))
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, field_names(cls)[0], None)
        assert dataclasses.replace(section) == section
    assert not hasattr(cfg, "sections"), "features read typed attributes, never a mapping of sections"


def test_every_key_and_default_is_the_one_of_the_schema_before(monkeypatch):
    monkeypatch.delenv("GPUGUARD_STATE_DIR", raising=False)  # a node whose gpuguard.env names no state directory
    cfg = default_config()
    for name, keys in BEFORE["sections"].items():
        assert list(field_names(SECTIONS[name])) == list(keys), f"{name}: keys and their order"
        assert cfg.as_mapping()[name] == {k: v["default"] for k, v in keys.items()}, name


def test_every_validator_answers_as_the_one_before():
    assert [repr(p) for p in PROBES] == BEFORE["probes"]
    for name, keys in BEFORE["sections"].items():
        for f in dataclasses.fields(SECTIONS[name]):
            assert _answers(validator_of(f)) == BEFORE["answers"][keys[f.name]["answers"]], f"{name}.{f.name}"
    assert set(PARAM_VALIDATORS) == set(BEFORE["check_params"])
    for pname, vid in BEFORE["check_params"].items():
        assert _answers(PARAM_VALIDATORS[pname]) == BEFORE["answers"][vid], pname
    assert removed_keys() == BEFORE["removed_keys"]


def test_a_feature_section_is_declared_in_the_config_package():
    owners = {name: cls.__module__ for name, cls in SECTIONS.items()}
    for feature in ("watch", "notify", "nccl", "templates", "metrics", "monitor", "store", "slurm", "xid"):
        assert owners[feature] == f"gpuguard.config.sections.{feature}"
    assert owners["simulation"] == "gpuguard.config.sections.simulate"
    assert {n for n, m in owners.items() if m == "gpuguard.config.core"} == {
        "node", "policy", "deadlines", "sources", "locking", "undrain", "reboot", "epilog", "logging"}


def test_a_feature_section_module_imports_nothing_but_the_field_helpers():
    for name, cls in SECTIONS.items():
        code = (f"import sys; before = set(sys.modules); import {cls.__module__}; "
                "print(sorted(m for m in set(sys.modules) - before if m.startswith('gpuguard')))")
        out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
        package = cls.__module__.rsplit(".", 1)[0]
        assert set(eval(out.stdout)) <= {"gpuguard", "gpuguard.config", "gpuguard.config.fields", package,
                                         cls.__module__, "gpuguard.util", "gpuguard.util.nodedirs", "gpuguard.util.record"}, name


def test_the_default_store_lives_in_the_nodes_state_directory(monkeypatch, tmp_path):
    """store.path's default follows $GPUGUARD_STATE_DIR (gpuguard.env), read when the config is built: several
    nodes on one host (or a site that moved its state directory) never share /var/lib/gpuguard/state.db, even when
    their config cannot be read and built-in defaults apply. A path the file names wins."""
    monkeypatch.setenv("GPUGUARD_STATE_DIR", str(tmp_path / "n1"))
    assert default_config().store.path == str(tmp_path / "n1" / "state.db")
    assert parse_config("policy: {on_failure: drain}\n", "c.yaml").store.path == str(tmp_path / "n1" / "state.db")
    assert parse_config("store:\n  path: /srv/gg/{node}.db\n", "c.yaml").store.path == "/srv/gg/{node}.db"
    monkeypatch.delenv("GPUGUARD_STATE_DIR")
    assert default_config().store.path == "/var/lib/gpuguard/state.db"


@pytest.mark.parametrize("text,message", [
    ("deadlines:\n  prolog_s: 30\n  prolog: 3\n",
     "c.yaml: line 3: deadlines.prolog: unknown key (did you mean 'prolog_s'?); known: prolog_s, epilog_s, "
     "healthcheck_s, manual_s, nvml_s, kernel_log_s, fabric_s, system_s, scontrol_s, imds_s"),
    ("watch:\n  dedupe_window_s: 60\n  start_at: never\n",
     "c.yaml: line 3: watch.start_at: expected one of auto, boot, end, got 'never'"),
    ("deadlines:\n\n  prolog_s: soon\n", "c.yaml: line 3: deadlines.prolog_s: expected a number, got 'soon'"),
    ("notify:\n  shared_dir: /shared\n",
     "c.yaml: line 2: notify.shared_dir: removed: fleet-wide grouping is Alertmanager's job now "
     "(notify.alertmanager_urls and observability/alertmanager.yml; docs/alerts.md)"),
    ("notify:\n  urls: json://hook/token\n",
     "c.yaml: line 2: notify.urls: expected a list of non-empty URL strings, got a str (value not shown: it may "
     "hold tokens)"),
])
def test_errors_name_the_file_the_line_and_the_key(text, message):
    with pytest.raises(ConfigError) as e:
        parse_config(text, source="c.yaml")
    assert str(e.value) == message


def test_lenient_parsing_keeps_the_good_keys_typed_and_says_what_a_typo_meant():
    cfg = parse_config("watch:\n  dedupe_window_s: 60\n  start_att: end\nnccl:\n  tier_enabled: true\n",
                       source="c.yaml", lenient=True)
    assert cfg.mode == "partial" and cfg.watch.dedupe_window_s == 60 and cfg.watch.start_at == "auto"
    assert cfg.nccl.tier_enabled is True and cfg.given == {"watch.dedupe_window_s", "nccl.tier_enabled"}
    [issue] = cfg.issues
    assert (issue.path, issue.line, issue.meant) == ("watch.start_att", 3, "watch.start_at")
    assert str(issue).startswith("line 3: watch.start_att: unknown key (did you mean 'start_at'?)")


def test_restricted_mode_when_nothing_usable_was_ever_seen(tmp_path):
    conf = tmp_path / "config.yaml"
    conf.write_text("deadlines: [not, a, mapping\n")
    cfg = load_guarded(str(conf), directory=str(tmp_path / "state"))
    assert cfg.mode == "defaults" and cfg.restricted
    assert cfg.deadlines == default_config().deadlines


def test_deadline_of_each_run_kind():
    dl = parse_config("deadlines:\n  prolog_s: 12\n  epilog_s: 13\n  healthcheck_s: 14\n  manual_s: 15\n").deadlines
    assert [dl.for_kind(k) for k in ("prolog", "epilog", "healthcheck", "manual")] == [12, 13, 14, 15]


def test_per_check_settings_are_a_typed_view():
    cfg = parse_config("checks:\n  gpu.nvlink: false\n  gpu.temperature: {warn_c: 70}\n")
    assert not cfg.checks.enabled("gpu.nvlink") and cfg.checks.enabled("gpu.xid")
    assert cfg.checks.params("gpu.temperature", {"warn_c": None, "fail_c": 90}) == {"warn_c": 70, "fail_c": 90}
    assert cfg.checks.as_mapping() == {"gpu.nvlink": {"enabled": False}, "gpu.temperature": {"warn_c": 70}}


def test_an_upgraded_node_reads_the_last_good_copy_the_version_before_wrote_without_yaml(tmp_path):
    """The compiled copy's format did not change: a node upgraded with an unchanged config keeps its last good
    configuration and its hot path (no YAML), and rebuilds the typed config from it."""
    conf = tmp_path / "config.yaml"
    shutil.copy(FIXTURES / "site-before-typed-config.yaml", conf)
    state = tmp_path / "state"
    state.mkdir()
    copy = cache_path(str(conf), str(state))
    shutil.copy(FIXTURES / "last-good-before-typed-config.json", copy)
    os.chmod(copy, 0o600)
    code = ("import sys; from gpuguard.siteconfig import load_guarded; "
            "c = load_guarded(sys.argv[1], directory=sys.argv[2]); "
            "print(repr((c.mode, c.deadlines.prolog_s, c.policy.on_failure, c.xid.overrides, c.watch.start_at, "
            "c.notify.cluster, c.checks.enabled('gpu.nvlink'), c.check_params('gpu.temperature', {}), "
            "'yaml' in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, str(conf), str(state)], capture_output=True, text=True,
                         check=True)
    assert eval(out.stdout) == ("ok", 12, "report", {13: {"action": "drain", "severity": "fatal"}}, "end", "c1",
                                False, {"warn_c": 70}, False)


def test_the_compiled_copy_round_trips_every_section(tmp_path):
    conf = tmp_path / "config.yaml"
    conf.write_text((FIXTURES / "site-before-typed-config.yaml").read_text() + "store:\n  retention_days: null\n")
    state = str(tmp_path / "state")
    parsed = load_guarded(str(conf), directory=state)
    again = load_guarded(str(conf), directory=state)  # from the compiled copy
    assert parsed.mode == again.mode == "ok"
    for name in SECTIONS:
        assert getattr(again, name) == getattr(parsed, name), name
    assert again.checks == parsed.checks and again.store.retention_days is None


def test_the_hot_path_never_runs_the_dataclass_machinery(tmp_path):
    """A hook in its own process pays for importing every section: they become dataclasses (fields, replace)
    only when asked, which a run from the compiled copy never does (gpuguard.config.fields)."""
    conf = tmp_path / "config.yaml"
    conf.write_text((FIXTURES / "site-before-typed-config.yaml").read_text())
    state = str(tmp_path / "state")
    load_guarded(str(conf), directory=state)
    code = ("import sys; from gpuguard.siteconfig import load_guarded; from gpuguard.config.schema import "
            "SECTIONS, Config, ConfigIssue; c = load_guarded(sys.argv[1], directory=sys.argv[2]); "
            "[getattr(c, n) for n in SECTIONS]; "
            "print([n for n, k in [*SECTIONS.items(), ('Config', Config), ('ConfigIssue', ConfigIssue)] "
            "if not k.__dict__['_dataclass_pending']])")
    out = subprocess.run([sys.executable, "-c", code, str(conf), state], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_feature_reads_a_string_key_path():
    """`cfg.sections["deadlines"]["prolog_s"]` is gone: a section is an attribute, a key is a field."""
    pattern = re.compile(r"\bsections\[|(?<!gpuguard\.config)\.sections\b")  # not the package of the sections
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for base in ("lib", "devtools", "tests") for path in (REPO / base).rglob("*.py")
            if path.name != "test_config_typed.py"
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
