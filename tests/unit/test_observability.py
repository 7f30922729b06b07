"""Observability as code: the Prometheus rules pass the real `promtool check rules` and `promtool test rules`, fire
from metric files gpuguard really wrote, use only metrics gpuguard writes, and link runbook sections that exist;
the Grafana dashboard is importable JSON whose every query promtool parses; every check has a runbook."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from test_metrics import PROMTOOL, MemorySlurm, make_cfg, run

from gpuguard.checks import registry
from gpuguard.metrics.heartbeat import watch_families
from gpuguard.metrics.textfile import write_families
from gpuguard.monitor.detect import Alert
from gpuguard.monitor.metrics import monitor_families

REPO = Path(__file__).resolve().parents[2]
OBS = REPO / "observability"
RULES = OBS / "gpuguard.rules.yml"
RULES_TEST = OBS / "gpuguard.rules.test.yml"
DASHBOARD = OBS / "gpuguard-dashboard.json"
RUNBOOKS = REPO / "docs" / "runbooks.md"
# drain reasons written outside the check registry (format_reason callers): internal errors, the NCCL sweep
EXTRA_DRAIN_CHECKS = ("gpuguard", "nccl.sweep")
# Grafana's variables, replaced by what Grafana would put there before the query reaches Prometheus
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "6h", "${node}": "node1|node2",
                "$node": "node1|node2"}


def promtool(*args: str, cwd: Path = OBS) -> subprocess.CompletedProcess:
    assert os.path.exists(PROMTOOL), "promtool missing: `make deps` installs Debian's prometheus package"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alerts() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def anchors() -> set[str]:
    return set(re.findall(r'<a id="([^"]+)"></a>', RUNBOOKS.read_text()))


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, rows' panels included."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"]))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def grafana_to_promql(expr: str) -> str:
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$labels", ""), f"unknown Grafana variable in {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(gpuguard_[a-z0-9_]+)\b(?!\.prom)", expr))  # not file names


# --------------------------------------------------------------------------- rules


def test_rules_pass_promtool_check_and_their_unit_tests():
    check = promtool("check", "rules", RULES.name)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    test = promtool("test", "rules", RULES_TEST.name)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_every_alert_is_unit_tested_firing_and_links_an_existing_runbook_section():
    tested = yaml.safe_load(RULES_TEST.read_text())
    firing = {c["alertname"] for t in tested["tests"] for c in t.get("alert_rule_test", []) if c.get("exp_alerts")}
    have = anchors()
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)) >= 14
    # what issue 11 asks the rules to cover
    assert {"GpuguardHealthCheckStale", "GpuguardNodeDrained", "GpuguardFatalXid", "GpuguardXidRateHigh",
            "GpuguardStraggler", "GpuguardJobHang", "GpuguardWatchDown"} <= set(names)
    for a in alerts():
        assert a["alert"] in firing, f"{a['alert']}: no promtool test where it fires"
        assert a["alert"] in have, f"{a['alert']}: no section in docs/runbooks.md"
        assert a["labels"]["severity"] in ("warning", "critical")
        assert a["annotations"]["summary"]
        url = a["annotations"]["runbook_url"]
        base, _, anchor = url.partition("#")
        assert base == "@RUNBOOK_URL@", url  # `make install` puts the site's RUNBOOK_URL there
        # the drained-node alert links the section of the check that drained the node
        assert anchor == a["alert"] or anchor == "{{ $labels.check }}", url


def test_every_check_has_a_runbook_section():
    have = anchors()
    missing = [s.id for s in registry() if s.id not in have] + [c for c in EXTRA_DRAIN_CHECKS if c not in have]
    assert missing == [], f"docs/runbooks.md lacks a section for {missing}"
    text = RUNBOOKS.read_text()
    for a in re.findall(r"\]\(#([^)]+)\)", text):  # links inside the document resolve
        assert a in have, a


def _series_line(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _scrapes(paths_by_step: list[Path]) -> list[dict[tuple[str, tuple], float]]:
    out = []
    for path in paths_by_step:
        samples = {}
        for fam in text_string_to_metric_families(path.read_text()):
            for s in fam.samples:
                labels = {**s.labels, "instance": "node2:9100", "job": "node"}
                samples[(s.name, tuple(sorted(labels.items())))] = s.value
        out.append(samples)
    return out


def test_alerts_fire_from_the_files_gpuguard_writes(tmp_path):
    """Real files, as Prometheus would scrape them every minute: a healthy node for 5 minutes, then a prolog drains
    it for Xid 79. The counters exist at 0 before the event, so increase() sees the first Xid and the drain."""
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    node_file = tmp_path / "prom" / "gpuguard_node.prom"
    run(cfg, "healthcheck", "healthy-p5", slurm)
    healthy = tmp_path / "healthy.prom"
    healthy.write_bytes(node_file.read_bytes())
    run(cfg, "prolog", "xid79", slurm, job="77")
    scrapes = _scrapes([healthy] * 5 + [node_file] * 15)
    keys = sorted({k for s in scrapes for k in s})
    series = []
    for name, labels in keys:
        values, gone = [], False
        for s in scrapes:
            if (name, labels) in s:
                values.append(repr(float(s[(name, labels)])))
            elif values and not gone and values[-1] not in ("_", "stale"):
                values.append("stale")  # a series no longer in the file: Prometheus marks it stale at once
                gone = True
            else:
                values.append("_")
        series.append({"series": _series_line(name, dict(labels)), "values": " ".join(values)})
    node = {"instance": "node2:9100", "job": "node", "node": "node2"}
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "GpuguardNodeDrained", "exp_alerts": []},
            {"eval_time": "4m", "alertname": "GpuguardFatalXid", "exp_alerts": []},
            {"eval_time": "8m", "alertname": "GpuguardNodeDrained", "exp_alerts": [{
                # the GPU the Xid line names (PCI 0000:86:00 = GPU 3 in the node's inventory)
                "exp_labels": {**node, "severity": "warning", "check": "gpu.xid", "keyword": "XID79", "gpu": "3"},
                "exp_annotations": {"summary": "node2 drained by gpuguard: XID79 (gpu.xid)",
                                    "runbook_url": "@RUNBOOK_URL@#gpu.xid"}}]},
            {"eval_time": "8m", "alertname": "GpuguardFatalXid", "exp_alerts": [{
                "exp_labels": {**node, "severity": "critical", "class": "fatal"},
                "exp_annotations": {"summary": "node2: fatal Xid in the kernel log",
                                    "runbook_url": "@RUNBOOK_URL@#GpuguardFatalXid"}}]},
        ]}]}
    path = tmp_path / "real.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    p = promtool("test", "rules", str(path), cwd=tmp_path)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


# --------------------------------------------------------------------------- the dashboard


def test_dashboard_is_importable_grafana_json():
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    names = {v["name"]: v for v in d["templating"]["list"]}
    assert names["datasource"]["type"] == "datasource" and names["datasource"]["query"] == "prometheus"
    assert names["node"]["type"] == "query" and "gpuguard_build_info" in names["node"]["definition"]
    ids: list[int] = []
    data_panels = 0

    def walk(panels: list[dict[str, Any]]) -> None:
        nonlocal data_panels
        for p in panels:
            ids.append(p["id"])
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
            walk(p.get("panels", []))
            if p["type"] in ("row", "text"):
                continue
            data_panels += 1
            assert p["title"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"] and all(t["refId"] and t["expr"].strip() for t in p["targets"]), p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]

    walk(d["panels"])
    assert len(ids) == len(set(ids)) and data_panels >= 15


def test_every_dashboard_query_parses_with_promtool(tmp_path):
    """promtool has no `check query`: each query becomes a recording rule of a generated rules file."""
    exprs = dashboard_exprs()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)} for i, (_, expr) in enumerate(exprs)]}]}
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    p = promtool("check", "rules", str(path), cwd=tmp_path)
    assert p.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in p.stdout, p.stdout + p.stderr


def test_a_broken_dashboard_query_is_caught(tmp_path):
    """The check above can fail: an unbalanced query is refused by promtool."""
    path = tmp_path / "bad.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "dashboard:bad", "expr": grafana_to_promql('sum by (node (gpuguard_node_drained{node=~"$node"})')}
    ]}]}))
    assert promtool("check", "rules", str(path), cwd=tmp_path).returncode != 0


# --------------------------------------------------------------------------- names: rules and dashboard vs the files


def test_rules_and_dashboard_use_only_metrics_gpuguard_writes(tmp_path):
    d = tmp_path / "prom"
    cfg = make_cfg(tmp_path, str(d))
    slurm = MemorySlurm()
    run(cfg, "healthcheck", "ecc-dbe", slurm)
    run(cfg, "prolog", "xid79", slurm, job="5150")  # drained: the drained-since series exists
    write_families(str(d), "watch", watch_families("node2", time.time(), time.time(), 30.0, True, 0))
    report = {"node": "node2", "job_id": "5150", "ts": time.time(), "interval_s": 10.0, "host": {},
              "last_iteration": 10, "last_progress": time.time(), "step_time_s": 1.0, "monitor_cpu_s": 0.1,
              "gpus": [{"index": 0, "uuid": "GPU-0", "util_pct": 50, "mem_used_mib": 1, "mem_total_mib": 2,
                        "temp_c": 50, "temp_slowdown_c": 87, "power_w": 100.0, "sm_clock_mhz": 1000,
                        "sm_clock_max_mhz": 1980, "mem_clock_mhz": 2619, "throttle_mask": 0}]}
    write_families(str(d), "monitor", monitor_families(
        report, [Alert("hang", "monitor.progress", "critical", "x", scope="job")], {"rss_bytes": 1.0}))
    written = {s.name for f in d.glob("*.prom") for fam in text_string_to_metric_families(f.read_text())
               for s in fam.samples}
    used = set()
    for a in alerts():
        used |= metric_names(a["expr"])
    for _, expr in dashboard_exprs():
        used |= metric_names(expr)
    assert used - written == set(), f"rules/dashboard query metrics gpuguard never writes: {used - written}"
    assert len(used) >= 25
    # docs/metrics.md documents every metric written, and nothing else (retired pages exist only on pre-Ampere GPUs,
    # which the simulated H100s are not)
    documented = metric_names((REPO / "docs" / "metrics.md").read_text())
    assert written - documented == set(), f"undocumented in docs/metrics.md: {written - documented}"
    # (and a pending drain's age exists only while slurmctld has not taken a drain: tests/unit/test_metrics.py)
    assert documented - written - {"gpuguard_gpu_retired_pages",
                                   "gpuguard_pending_drain_oldest_timestamp_seconds"} == set(), documented - written


def test_promql_examples_in_the_docs_parse(tmp_path):
    text = (REPO / "docs" / "metrics.md").read_text()
    exprs = [ln.split("  #")[0].strip() for block in re.findall(r"```promql\n(.*?)```", text, re.S)
             for ln in block.splitlines() if ln.strip()]
    path = tmp_path / "docs.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "docs", "rules": [
        {"record": f"docs:example_{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    p = promtool("check", "rules", str(path), cwd=tmp_path)
    assert len(exprs) >= 5 and p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("name", ["gpuguard.rules.yml", "gpuguard-dashboard.json"])
def test_observability_files_are_installed_by_make_install(name):
    """The install target copies the dashboard and runbooks and substitutes the runbook URL into the rules."""
    makefile = (REPO / "Makefile").read_text()
    install = makefile.split("\ninstall:", 1)[1].split("\n\n", 1)[0]
    assert "share/gpuguard/observability" in install
    assert f"observability/{name}" in install or (name in install and "observability/$$f" in install)


def test_make_install_substitutes_the_runbook_url(tmp_path):
    """The install line itself, run as make would run it (make -n prints the recipe without running it)."""
    prefix = tmp_path / "prefix"
    p = subprocess.run(["make", "-n", "install", f"PREFIX={prefix}", "RUNBOOK_URL=https://wiki.example/gpuguard"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    commands = p.stdout.replace("\\\n", " ").splitlines()  # make -n keeps a recipe line's continuations
    lines = [ln for ln in commands if "share/gpuguard/observability" in ln and not ln.lstrip().startswith("#")]
    assert len(lines) == 1, p.stdout + p.stderr
    subprocess.run(["bash", "-c", lines[0]], cwd=REPO, check=True, timeout=60)
    installed = prefix / "share" / "gpuguard" / "observability"
    assert sorted(x.name for x in installed.iterdir()) == ["alertmanager.yml", "gpuguard-dashboard.json",
                                                          "gpuguard.rules.test.yml", "gpuguard.rules.yml",
                                                          "runbooks.md"]
    for name in ("gpuguard.rules.yml", "gpuguard.rules.test.yml"):
        text = (installed / name).read_text()
        assert "@RUNBOOK_URL@" not in text and "https://wiki.example/gpuguard#" in text, name
    assert promtool("check", "rules", str(installed / "gpuguard.rules.yml"), cwd=tmp_path).returncode == 0
    # the installed rules pass their installed tests, in the directory they were installed to
    assert promtool("test", "rules", "gpuguard.rules.test.yml", cwd=installed).returncode == 0
