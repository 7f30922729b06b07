"""`gpuguard preflight` with `nccl.preflight_backend: nccl-tests` on nodes really apart (devtools.devnetns, as
test_preflight_netns.py): every group of every round is a real `srun` step inside the job's real allocation, of the
simulated all_reduce_perf measuring for real (scenario `nccl: {measure: tcp}`: a ring all_reduce over TCP between
the nodes' own addresses, devtools.nccl_ring), so a node whose link is slowed with tc tbf really reads slow. A healthy
allocation passes and its ranks run with the NCCL environment preset; node3 slowed is blamed and drained with the
bus bandwidth it measured."""

from __future__ import annotations

import json
import re

import pytest
from preflightnet import BUDGET, NCCL, preflight_samples, run_preflight
from torchjob import NEEDS_HOST_VIEW, netns_site

from devtools.nccl_tests_stub import install_stub

pytestmark = [NEEDS_HOST_VIEW]

# a site preset variable (templates.presets, merged over the shipped ones) the ranks must see, beside generic's own
SITE_ENV = {"name": "NCCL_BUFFSIZE", "value": "2097152", "why": "the site's tuning (test)"}


def nccl_tests_site(site_factory):
    site = netns_site(site_factory, nodes=4)
    scen = site.workdir / "nccl-scenarios"
    scen.mkdir()
    envs = site.workdir / "nccl-env"
    envs.mkdir(mode=0o1777)
    envs.chmod(0o1777)
    (scen / "default.yaml").write_text(f"nccl: {{measure: tcp, env_dir: {envs}}}\n")
    stub = install_stub(str(site.workdir / "bin"), str(scen))
    site.write_config({"nccl": {**NCCL, "preflight_backend": "nccl-tests", "sweep_binary": str(stub),
                                "sweep_gpus_per_node": 1, "sweep_mpi": "none"},
                       "templates": {"presets": {"common": {"env": [SITE_ENV]}}}})
    return site, envs


@pytest.mark.slow(60)
def test_nccl_tests_measure_the_slowed_node_which_is_blamed_and_drained_and_a_healthy_allocation_passes(
        site_factory):
    site, envs = nccl_tests_site(site_factory)
    out, took = run_preflight(site)
    print(f"healthy: {took:.1f}s from sbatch: {out}")
    assert re.search(r"gpuguard preflight: 4 nodes node\[1-4\] in [\d.]+s: passed, busbw", out), out
    assert "preflight-rc=0" in out and "workers up" not in out, out  # no torch worker on this path
    assert "[floor 0.005 GB/s (config), NCCL preset generic / " in out and "sample recorded" in out, out
    assert preflight_samples(site, "nccl-tests") == 1 and preflight_samples(site, "gloo") == 0  # its own kind
    # every rank of every step was started with the preset: the shipped generic one and the site's addition
    seen = {p.name: json.loads(p.read_text()) for p in envs.glob("*.json")}
    assert {name.split(".")[0] for name in seen} == {"node1", "node2", "node3", "node4"}, sorted(seen)
    assert all(e.get("NCCL_BUFFSIZE") == "2097152" and e.get("NCCL_DEBUG") == "WARN" and
               e.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "3" for e in seen.values()), seen

    site.cluster.host_view.slow_link(3, "20mbit")
    out, took = run_preflight(site)
    print(f"node3 slowed: {took:.1f}s from sbatch: {out}")
    assert float(re.search(r"in ([\d.]+)s: ", out).group(1)) <= BUDGET, out
    blamed = re.search(r"blamed node3 \(NCCL fabric.nccl: busbw ([\d.]+) GB/s vs ([\d.]+) with peers", out)
    assert blamed and float(blamed.group(1)) < NCCL["preflight_busbw_gbps"] < float(blamed.group(2)), out
    assert "GPUGUARD_PREFLIGHT_EXCLUDE=node3\n" in out and "preflight-rc=10" in out, out
    info = site.cluster.nodes_info()
    assert "DRAIN" in info["node3"]["State"], info["node3"]
    assert info["node3"]["Reason"].startswith(f"gpuguard: NCCL fabric.nccl: busbw {blamed.group(1)} GB/s"), info
    assert [n for n in ("node1", "node2", "node4") if "DRAIN" in info[n]["State"]] == [], out
    journal = json.loads((site.workdir / "run" / "node3.journal.json").read_text())
    cond = [c for c in journal.get("conditions", []) if c["origin"] == "preflight"]
    assert cond and cond[0]["check_id"] == "fabric.nccl", journal
    assert 0 < cond[0]["evidence"]["busbw_gbps"] < NCCL["preflight_busbw_gbps"], (cond, out)  # what it measured
    assert preflight_samples(site, "nccl-tests") == 1  # a pre-flight that blamed a node adds nothing
