"""gpuguard.config.lastgood: a config mistake never switches protection off and never drains a fleet (issue 14)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuguard.siteconfig import parse_config
from gpuguard.config.lastgood import cache_path, describe, read_last_good
from gpuguard.siteconfig import load_guarded

GOOD = """\
deadlines:
  prolog_s: 12
policy:
  on_failure: report
checks:
  gpu.temperature: {warn_c: 70}
xid:
  overrides:
    13: {severity: fatal, action: drain}
notify:
  urls: ["json://example.invalid/hook?token=SECRET"]
"""


@pytest.fixture
def site(tmp_path):
    conf = tmp_path / "config.yaml"
    state = tmp_path / "state"
    return conf, str(state)


def _good_then(conf, state, text):
    conf.write_text(GOOD)
    first = load_guarded(str(conf), directory=state)
    assert first.mode == "ok" and not first.issues
    conf.write_text(text)
    return load_guarded(str(conf), directory=state)


def test_a_valid_file_becomes_the_last_good_one_private_and_is_read_back_without_yaml(site):
    conf, state = site
    conf.write_text(GOOD)
    load_guarded(str(conf), directory=state)
    path = cache_path(str(conf), state)
    assert os.stat(path).st_mode & 0o777 == 0o600  # it holds notification tokens
    code = ("import sys; from gpuguard.siteconfig import load_guarded; "
            "c = load_guarded(sys.argv[1], directory=sys.argv[2]); "
            "print(c.mode, c.deadlines.prolog_s, c.xid.overrides, "
            "'yaml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(conf), state], capture_output=True, text=True, check=True)
    assert out.stdout.split(" ", 2)[:2] == ["ok", "12"]
    assert "{13: {" in out.stdout and "'severity': 'fatal'" in out.stdout  # Xid codes stay integers
    assert out.stdout.strip().endswith("False"), "unchanged file: the compiled copy, no YAML import"


@pytest.mark.parametrize("bad,key,line", [
    (GOOD.replace("prolog_s: 12", "prolog_s: soon"), "deadlines.prolog_s", 2),
    (GOOD.replace("on_failure: report", "on_faliure: report"), "policy.on_faliure", 4),
    (GOOD.replace("{warn_c: 70}", "{warn_cc: 70}"), "checks.gpu.temperature.warn_cc", 6),
])
def test_one_bad_key_keeps_the_rest_of_the_file_and_takes_its_last_good_value(site, bad, key, line):
    conf, state = site
    cfg = _good_then(conf, state, bad.replace("prolog_s: 12", "prolog_s: 12") + "logging:\n  level: debug\n")
    assert cfg.mode == "partial"
    assert [(i.path, i.line) for i in cfg.issues] == [(key, line)]
    assert cfg.logging.level == "debug", "the good keys of the new file apply"
    assert cfg.deadlines.prolog_s == 12 and cfg.policy.on_failure == "report"
    assert cfg.check_params("gpu.temperature", {})["warn_c"] == 70
    assert key in describe(cfg) and f"line {line}" in describe(cfg)


@pytest.mark.parametrize("breaker", [
    lambda c: c.write_text(GOOD + "\nnode: [unclosed\n"),  # not YAML
    lambda c: c.write_text("- a list\n- not a mapping\n"),
    lambda c: c.unlink(),  # deleted by a bad rollout
])
def test_an_unusable_file_is_replaced_by_the_last_good_configuration(site, breaker):
    conf, state = site
    conf.write_text(GOOD)
    load_guarded(str(conf), directory=state)
    breaker(conf)
    cfg = load_guarded(str(conf), directory=state)
    assert cfg.mode == "last-good" and len(cfg.issues) == 1 and cfg.issues[0].path == "(file)"
    assert cfg.policy.on_failure == "report" and cfg.notify.urls
    assert not cfg.restricted


def test_with_no_last_good_only_unambiguous_evidence_may_drain(site):
    conf, state = site
    conf.write_text("deadlines: {prolog_s: soon\n")
    cfg = load_guarded(str(conf), directory=state)
    assert cfg.mode == "defaults" and cfg.restricted and cfg.issues


def test_a_misspelt_key_beside_the_key_itself_does_not_override_it(site):
    conf, state = site
    cfg = _good_then(conf, state, GOOD.replace("on_failure: report", "on_failure: drain\n  on_faliure: report"))
    assert cfg.mode == "partial" and cfg.policy.on_failure == "drain"


def test_a_partial_file_without_last_good_keeps_its_defaults(site):
    conf, state = site
    conf.write_text("deadlines:\n  prolog_s: -1\n")
    cfg = load_guarded(str(conf), directory=state)
    assert cfg.mode == "partial" and cfg.deadlines.prolog_s == 30.0 and not cfg.restricted


def test_a_last_good_file_others_can_write_is_not_trusted(site):
    conf, state = site
    conf.write_text(GOOD)
    load_guarded(str(conf), directory=state)
    path = cache_path(str(conf), state)
    assert read_last_good(path) is not None
    os.chmod(path, 0o666)
    assert read_last_good(path) is None
    os.chmod(path, 0o600)
    doc = json.loads(open(path).read())
    doc["version"] = 999
    open(path, "w").write(json.dumps(doc))
    assert read_last_good(path) is None


def test_the_absent_default_file_is_not_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUGUARD_CONFIG", raising=False)
    import gpuguard.config.schema as config

    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", str(tmp_path / "none.yaml"))
    cfg = load_guarded(None, directory=str(tmp_path))
    assert cfg.mode == "ok" and not cfg.issues


def test_config_check_names_every_bad_key_with_its_line(tmp_path, capsys):
    from gpuguard.cli.main import main

    f = tmp_path / "new.yaml"
    f.write_text("deadlines:\n  prolog_s: soon\n  nvml_s: 5\npolicy:\n  on_faliure: drain\nchecks:\n  gpu.temprature: {}\n")
    assert main(["config", "--check", str(f)]) == 1
    out = capsys.readouterr().out
    assert "line 2: deadlines.prolog_s" in out and "line 5: policy.on_faliure" in out
    assert "did you mean 'on_failure'" in out and "line 7: checks.gpu.temprature" in out
    assert "INVALID: 3 problem(s)" in out
    f.write_text(GOOD)
    assert main(["config", "--check", str(f)]) == 0


def test_strict_parsing_still_raises_at_the_first_problem():
    from gpuguard.config.schema import ConfigError

    with pytest.raises(ConfigError, match="line 2: deadlines.prolog_s"):
        parse_config("deadlines:\n  prolog_s: soon\n", source="c.yaml")
