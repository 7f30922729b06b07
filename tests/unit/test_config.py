"""Config: defaults, validation errors that name the key and the line, kill switches."""

import pytest

from gpuguard.config.schema import ConfigError
from gpuguard.siteconfig import load_config, parse_config


def test_empty_config_gives_defaults():
    cfg = parse_config("")
    assert cfg.policy.on_internal_error == "open"
    assert cfg.deadlines.prolog_s == 30.0
    assert cfg.check_enabled("gpu.xid")


def test_kill_switch_and_params():
    cfg = parse_config("checks:\n  gpu.nvlink: false\n  gpu.temperature:\n    warn_c: 70\n    fail_c: 85\n")
    assert not cfg.check_enabled("gpu.nvlink")
    assert cfg.check_params("gpu.temperature", {"warn_c": None, "fail_c": None}) == {"warn_c": 70, "fail_c": 85}
    cfg = parse_config("checks:\n  fabric.efa:\n    enabled: false\n")
    assert not cfg.check_enabled("fabric.efa")


@pytest.mark.parametrize("text,line,key,words", [
    ("deadlines:\n  prolog_s: soon\n", 2, "deadlines.prolog_s", "expected a number"),
    ("policy:\n  on_internal_error: maybe\n", 2, "policy.on_internal_error", "open, closed"),
    ("node:\n  profile: p5.48xlarge\nchekcs:\n  gpu.xid: false\n", 3, "chekcs", "did you mean 'checks'"),
    ("checks:\n  gpu.nvlnk: false\n", 2, "checks.gpu.nvlnk", "did you mean 'gpu.nvlink'"),
    ("checks:\n  gpu.temperature:\n    warn: 70\n", 3, "checks.gpu.temperature.warn", "unknown parameter"),
    ("checks:\n  sys.disk:\n    paths:\n      - {path: tmp}\n", 3, "checks.sys.disk.paths", "absolute"),
    ("store:\n  path: /x\n  paht: /y\n", 3, "store.paht", "did you mean 'path'"),
])
def test_errors_name_key_and_line(text, line, key, words):
    with pytest.raises(ConfigError) as e:
        parse_config(text, source="/etc/gpuguard/config.yaml")
    msg = str(e.value)
    assert msg.startswith(f"/etc/gpuguard/config.yaml: line {line}: {key}:"), msg
    assert words in msg


def test_yaml_syntax_error_names_line():
    with pytest.raises(ConfigError) as e:
        parse_config("policy:\n  on_failure: drain\n   bad: [\n", source="c.yaml")
    assert "c.yaml: line" in str(e.value)


def test_duplicate_key_is_an_error():
    with pytest.raises(ConfigError) as e:
        parse_config("store:\n  path: /a\n  path: /b\n", source="c.yaml")
    assert "duplicate key 'path'" in str(e.value) and "line 3" in str(e.value)


def test_xid_overrides_validated():
    cfg = parse_config("xid:\n  overrides:\n    94: {severity: fatal, action: reset}\n")
    assert cfg.xid.overrides == {94: {"severity": "fatal", "action": "reset"}}
    with pytest.raises(ConfigError) as e:
        parse_config("xid:\n  overrides:\n    94: {severity: deadly}\n", source="c.yaml")
    assert "line 2" in str(e.value) and "xid.overrides" in str(e.value)


def test_explicit_missing_file_is_an_error_default_is_not(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUGUARD_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))
    monkeypatch.setenv("GPUGUARD_CONFIG", str(tmp_path / "c.yaml"))
    (tmp_path / "c.yaml").write_text("policy:\n  on_failure: report\n")
    assert load_config().policy.on_failure == "report"
