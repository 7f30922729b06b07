"""Secrets never leak (gpuguard.util.redact): passwords in store.url whatever characters they hold (unencoded '/', '?',
'#', '@'), sslpassword and other password-like parameters, every notification URL, in `gpuguard config`, config
errors in the hooks' log, fleet messages and notification errors. Property-tested on generated URLs: the secret
is written in upper case and nothing else is, so "no upper-case letter in the output" means "no piece of the
secret in the output"."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from urllib.parse import quote

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from propbudget import examples
from clirun import gpuguard

from gpuguard.config.schema import ConfigError
from gpuguard.siteconfig import parse_config
from gpuguard.util.redact import redact_notify_url, redact_url, scrub

UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DELIMS = "/?#@:&=%+;!$'()*,[] ~"
# a secret: runs of upper-case letters, each after a delimiter (every piece a bad split could cut off is marked)
secrets = st.lists(st.tuples(st.sampled_from(["", *DELIMS]), st.text(UPPER, min_size=1, max_size=5)),
                   min_size=1, max_size=5).map(lambda parts: "".join(d + t for d, t in parts))
lower = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8)
hosts = st.builds(lambda a, b: f"{a}.{b}" if b else a, lower, st.one_of(st.just(""), lower))
ports = st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}"))
paths = st.lists(lower, max_size=3).map(lambda ps: "".join("/" + p for p in ps))
safe_params = st.lists(st.sampled_from(["sslmode=require", "connect_timeout=5", "application_name=gpuguard",
                                        "host=/run/postgresql", "target_session_attrs=any"]), max_size=3)


def no_secret(text: str) -> bool:
    """No upper-case letter, once the upper-case words of gpuguard's own messages are taken out."""
    return not any(c in UPPER for c in re.sub(r"USER|HOST|PORT|DATABASE|DB|URL|ConfigError", "", text))


@st.composite
def urls(draw):
    """A URL with a secret as password (raw or percent-encoded) and/or in a password-like query parameter."""
    scheme = draw(st.sampled_from(["postgresql", "postgres", "http", "https", "json"]))
    user = draw(st.one_of(st.just(""), lower))
    where = draw(st.sampled_from(["userinfo", "userinfo-encoded", "query", "both"]))
    userinfo = f"{user}@" if user else ""
    if where.startswith("userinfo") or where == "both":
        secret = draw(secrets)
        userinfo = f"{user}:{quote(secret, safe='') if where.endswith('encoded') else secret}@"
    params = list(draw(safe_params))
    if where in ("query", "both"):
        value = draw(secrets).replace("&", "")  # a raw '&' ends a parameter in every parser: not a value's
        if not value or not any(c in UPPER for c in value):
            value += "Q"
        params.insert(draw(st.integers(0, len(params))),
                      f"{draw(st.sampled_from(['password', 'sslpassword', 'token', 'apikey']))}={value}")
    query = ("?" + "&".join(params)) if params else ""
    return f"{scheme}://{userinfo}{draw(hosts)}{draw(ports)}{draw(paths)}{query}"


@settings(max_examples=examples(600), deadline=None)
@given(urls())
def test_no_piece_of_a_secret_survives_redact_url(url):
    out = redact_url(url)
    assert no_secret(out), (url, out)


@settings(max_examples=examples(200), deadline=None)
@given(urls())
def test_a_notification_url_shows_its_scheme_only(url):
    out = redact_notify_url(url)
    assert no_secret(out) and out.endswith("://***")


@settings(max_examples=examples(300), deadline=None)
@given(urls(), st.text("abc xyz123 :/.-", max_size=30), st.data())
def test_scrub_removes_every_slice_of_a_secret_from_an_error_text(url, noise, data):
    """What a library's exception may quote: the URL, its password, or any slice of them (libpq's
    'missing key/value separator "=" in URI query parameter: "w#rd@127.0.0.1:1/fleet"')."""
    start = data.draw(st.integers(0, len(url)))
    text = f"{noise} connecting to {url}: {url[start:]} {noise}"
    out = scrub(text, [url])
    assert not any(len(run) >= 4 for run in re.findall(f"[{UPPER}]+", out)), (url, out)


@settings(max_examples=examples(300), deadline=None)
@given(urls())
def test_a_store_url_is_either_accepted_and_printed_without_its_password_or_refused_without_it(url):
    url = "postgresql" + url[url.index("://"):]
    try:
        cfg = parse_config(f"store: {{path: /tmp/x.db, url: {json.dumps(url)}}}\n", source="c.yaml")
    except ConfigError as e:
        assert no_secret(str(e)), (url, str(e))
        return
    assert no_secret(json.dumps(cfg.redacted_mapping()["store"])), url


def test_examples_from_the_issue():
    assert redact_url("postgresql://gg:pa/ss?w#rd@db:5433/fleet?sslmode=require") == \
        "postgresql://gg:***@db:5433/fleet?sslmode=require"
    assert redact_url("postgresql://gg@db/fleet?sslmode=verify-full&sslpassword=K3Y&sslcert=/etc/c.pem") == \
        "postgresql://gg@db/fleet?sslmode=verify-full&sslpassword=***&sslcert=/etc/c.pem"
    assert redact_url("postgresql://gg:s3cr3t@db:port/fleet") == "postgresql://***@db:port/fleet"  # no parse
    assert redact_url("postgresql://gg@db/fleet") == "postgresql://gg@db/fleet"
    assert redact_url("host=db password=x") == "<not a URL>"
    assert redact_notify_url("slack://T0KEN/B0KEN/XXXX/#gpu") == "slack://***"
    assert redact_url("https://gpuguard:pa@ss@am.example:9093/prefix") == "https://gpuguard:***@am.example:9093/prefix"


def test_gpuguard_config_prints_no_secret(tmp_path):
    """The issue's case: a password with '/', '?' and '#' in store.url (refused: libpq cannot parse it either,
    and the error is redacted), a well-formed one with sslpassword (printed masked), tokens in apprise URLs and
    a password in an Alertmanager URL."""
    conf = tmp_path / "config.yaml"
    conf.write_text(yaml.safe_dump({"store": {"url": "postgresql://gg:S3C/R3T?P#W@db:5433/fleet"}}))
    p = gpuguard("config", "--config", str(conf))
    assert p.returncode != 0 and "percent-encode" in p.stderr and "gg:***@db:5433" in p.stderr
    assert no_secret(p.stdout + p.stderr)
    conf.write_text(yaml.safe_dump({
        "store": {"url": "postgresql://gg:S3C%2FR3T%3FP%23W@db:5433/fleet?sslmode=require&sslpassword=K3YPASS"},
        "notify": {"urls": ["slack://TOKENA/TOKENB/TOKENC/#gpu", "mailtos://u:MAILPW@mail.example.com"],
                   "alertmanager_urls": ["https://gg:AMPASS@am1.example:9093", "http://am2.example:9093"]}}))
    p = gpuguard("config", "--config", str(conf))
    assert p.returncode == 0, p.stderr
    shown = json.loads(p.stdout.split("\n", 1)[1])["sections"]
    assert shown["store"]["url"] == "postgresql://gg:***@db:5433/fleet?sslmode=require&sslpassword=***"
    assert shown["notify"]["urls"] == ["slack://***", "mailtos://***"]
    assert shown["notify"]["alertmanager_urls"] == ["https://gg:***@am1.example:9093", "http://am2.example:9093"]
    for secret in ("S3C", "R3T", "K3YPASS", "TOKENA", "MAILPW", "AMPASS"):
        assert secret not in p.stdout


@pytest.mark.parametrize("url", ["postgresql://gg:pa/ss?w#rd@db/fleet", "postgresql://gg:pa@ss@db/fleet",
                                 "postgresql://gg:PW@db/fleet?password=X@Y"])
def test_an_ambiguous_store_url_is_refused_with_advice_and_without_the_password(url):
    with pytest.raises(ConfigError) as e:
        parse_config(f"store: {{path: /tmp/x.db, url: {json.dumps(url)}}}\n", source="c.yaml")
    assert "percent-encode" in str(e.value)
    for piece in ("ss", "w#rd", "PW", "X@Y"):
        assert f"{piece}@" not in str(e.value) and f":{piece}" not in str(e.value)


def test_a_config_error_in_the_hooks_log_quotes_no_secret(tmp_path):
    """A hook whose config has a bad store.url logs what is wrong (and runs with the rest of the file): the line
    must not carry the password."""
    from gpuguard.simulate.build import build_fake_nvml

    from simnode import SCENARIOS, gpuguard_dirs

    conf = tmp_path / "config.yaml"
    conf.write_text(yaml.safe_dump({
        "store": {"path": str(tmp_path / "state" / "{node}.db"), "url": "postgresql://gg:S3C/R3T@db/fleet"},
        "simulation": {"scenario": str(SCENARIOS / "healthy-p5.yaml"), "workdir": str(tmp_path / "sim"),
                       "fake_nvml": str(build_fake_nvml())}, "logging": {"syslog": False}}))
    p = subprocess.run([sys.executable, "-m", "gpuguard", "prolog", "--config", str(conf)], capture_output=True,
                       text=True, timeout=60, env={**gpuguard_dirs(), "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "1",
                                                    "PATH": "/usr/bin"})
    assert p.returncode == 0 and "config broken" in p.stderr and "store.url" in p.stderr, p.stderr
    assert "S3C" not in p.stderr and "R3T" not in p.stderr


def test_fleet_messages_use_the_same_redaction():
    from gpuguard.fleet import url as fleet_url
    from gpuguard.util.redact import redact_url as the_one

    assert fleet_url.redact_url is the_one
