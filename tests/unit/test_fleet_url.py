"""store.url: validated by the config schema with errors that never show the password; redacted everywhere."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuguard.config.schema import ConfigError
from gpuguard.siteconfig import parse_config
from gpuguard.config.pgurl import validate_url
from gpuguard.fleet.url import db_fingerprint, redact_url

SECRET = "s3cr3t-Pa55"


def cfg(url):
    return parse_config(f"store:\n  path: /tmp/x.db\n  url: {url!r}\n", source="/etc/gpuguard/config.yaml")


def test_valid_urls():
    assert cfg(f"postgresql://gg:{SECRET}@db.example:5433/fleet").store.url.endswith("/fleet")
    assert cfg("postgres://gg@db/fleet").store.url
    assert cfg("postgresql://gg@/fleet?host=/run/postgresql").store.url  # unix socket
    defaults = parse_config("", source="x").store
    assert defaults.url is None and defaults.retention_days == 90 and defaults.ship_budget_s == 2.0


@pytest.mark.parametrize("url, message", [
    (f"mysql://gg:{SECRET}@db/fleet", "expected a postgresql:// URL"),
    (f"postgresql://gg:{SECRET}@db:port/fleet", "not a valid URL"),
    (f"postgresql://gg:{SECRET}@/fleet", "names no host"),
    (f"postgresql://gg:{SECRET}@db", "names no database"),
    (f"postgresql://gg@db/fleet?password={SECRET}&sslmode=require&x=%00", "control characters"),
])
def test_bad_urls_are_config_errors_without_the_password(url, message):
    with pytest.raises(ConfigError) as e:
        cfg(url)
    text = str(e.value)
    assert "line 3: store.url:" in text and message in text and SECRET not in text and "***" in text


def test_other_bad_values():
    with pytest.raises(ConfigError, match="store.url"):
        parse_config("store: {url: 5432}", source="x")
    with pytest.raises(ConfigError, match="store.retention_days"):
        parse_config("store: {retention_days: 0}", source="x")


def test_redact_and_fingerprint():
    assert redact_url(f"postgresql://gg:{SECRET}@db:5433/fleet?sslmode=require") == \
        "postgresql://gg:***@db:5433/fleet?sslmode=require"
    assert SECRET not in redact_url(f"postgresql://gg@db/fleet?password={SECRET}")
    assert redact_url("postgresql://gg@db/fleet") == "postgresql://gg@db/fleet"
    assert db_fingerprint(f"postgresql://gg:{SECRET}@db/fleet") == "db:5432/fleet"
    assert db_fingerprint("postgresql://x@/fleet?host=/run/postgresql&port=5433") == "/run/postgresql:5433/fleet"
    assert validate_url(" postgresql://a@b/c ") == "postgresql://a@b/c"


def test_prolog_imports_neither_psycopg_nor_the_fleet_package(tmp_path):
    """A prolog never waits on the network: with store.url set it records locally and imports nothing of the
    shipper, nor the fleet package at all (the url validator the config needs is gpuguard.config.pgurl)."""
    conf = tmp_path / "c.yaml"
    conf.write_text(f"store:\n  path: {tmp_path}/s.db\n  url: postgresql://gg:{SECRET}@10.255.255.1/fleet\n"
                    "logging: {syslog: false}\n")
    code = ("import sys; from gpuguard.siteconfig import load_config; load_config(sys.argv[1]); "
            "from gpuguard.cli.main import build_hook_parser; import gpuguard.pipeline.run; "
            "print(sorted(m for m in sys.modules if m.startswith(('psycopg', 'gpuguard.fleet'))))")
    p = subprocess.run([sys.executable, "-c", code, str(conf)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
