"""`gpuguard history` on a big store (~100k runs, 400k findings): filtered in SQL and streamed, so the default view
answers in well under a second of query time and even `--limit 0` (every row) keeps memory flat. Timings are
generous for a loaded 2-core CI machine; the figures are printed (`pytest -s`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from gpuguard.store.sqlite import Store

from test_history_filters import bulk_healthy_runs, record_xid_drain

N_RUNS = 100_000

# Runs `gpuguard ...` as a child and prints its wall time and peak RSS (only that child is waited for).
MEASURE = """
import resource, subprocess, sys, time
t0 = time.monotonic()
with open(sys.argv[1], "wb") as out:
    rc = subprocess.run(sys.argv[2:], stdout=out, stderr=subprocess.PIPE).returncode
print(rc, time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.fixture(scope="module")
def store_100k(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    now = time.time()
    path = str(d / "node1.db")
    bulk_healthy_runs(path, "node1", N_RUNS, now - 13 * 86400, 13 * 86400 / N_RUNS)
    with Store(path) as st:
        for age_d in (12, 6, 0.5):
            record_xid_drain(st, "node1", now - age_d * 86400)
    cfg = d / "config.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"path": path}}))
    return cfg, d


def measure(cfg, out, *args):
    p = subprocess.run([sys.executable, "-c", MEASURE, str(out), sys.executable, "-m", "gpuguard", *args,
                        "--config", str(cfg)], capture_output=True, text=True, timeout=300)
    rc, took, rss_kib = p.stdout.split()
    return int(rc), float(took), int(rss_kib) / 1024


def test_default_view_of_100k_runs_is_fast_and_complete(store_100k):
    cfg, d = store_100k
    rc, took, rss = measure(cfg, d / "out.json", "history", "--since", "14d", "--json")
    print(f"\nhistory --since 14d --json over {N_RUNS} runs: {took:.2f}s, {rss:.0f} MiB peak RSS")
    assert rc == 0
    h = json.loads((d / "out.json").read_text())
    assert len(h["drains"]) == 3 and len(h["findings"]) == 3 and h["counts"]["runs"] == N_RUNS + 3
    assert took < 8 and rss < 150
    rc, took, _ = measure(cfg, d / "out.txt", "history", "--since", "14d", "--keyword", "XID79", "--check", "gpu.xid")
    print(f"history --keyword XID79 --check gpu.xid: {took:.2f}s")
    assert rc == 0 and "drains (3):" in (d / "out.txt").read_text() and took < 8


def test_every_row_streams_in_flat_memory(store_100k):
    cfg, d = store_100k
    rc, took, rss = measure(cfg, d / "all.csv", "history", "--since", "14d", "--limit", "0", "--csv")
    lines = (d / "all.csv").read_text().count("\n")
    print(f"\nhistory --limit 0 --csv: {lines - 1} rows in {took:.2f}s, {rss:.0f} MiB peak RSS")
    assert rc == 0 and lines == 1 + N_RUNS + 3 + 3  # header, runs, drain runs, drains
    assert took < 60 and rss < 150
    rc, took, rss = measure(cfg, d / "all.json", "history", "--since", "14d", "--limit", "0", "--json")
    print(f"history --limit 0 --json: {took:.2f}s, {rss:.0f} MiB peak RSS")
    assert rc == 0 and len(json.loads((d / "all.json").read_text())["runs"]) == N_RUNS + 3
    assert took < 60 and rss < 150
