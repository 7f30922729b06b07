"""The pre-flight's nccl-tests rounds (gpuguard.preflight.nccltests): every group an srun step of the sweep's
all_reduce_perf. `srun` is replaced by a script that runs the step's command here with the step's node list (what
Slurm would do across the nodes), and all_reduce_perf is the simulated nccl-tests (devtools/nccl_tests_stub.py) over
per-node scenarios: a healthy round, a slow node blamed through the real blame, a hung step stopped on time."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from clirun import gpuguard

from devtools.nccl_tests_stub import install_stub
from gpuguard.nccl.sweep import JobSpec, nccl_tests_argv, render_job
from gpuguard.preflight.blame import run_blame
from gpuguard.preflight.judge import round_measurements
from gpuguard.preflight.nccltests import NcclTestsRounds, row_busbw, step_argv, step_result
from gpuguard.preflight.pool import LATE_MIN_S
from gpuguard.preflight.protocol import SIZE_FACTOR
from gpuguard.preflight.runner import PoolMeasure

NODES = ["node1", "node2", "node3", "node4"]
JOB = {"backend": "nccl-tests", "min_bytes": 65536, "max_bytes": 4194304, "iters": 3}
STOP_GRACE_S = 3.5  # srun's own stop (SIGINT twice, a second apart), then SIGKILL


@pytest.fixture
def site(tmp_path):
    """(spec, scenario dir, fake srun, the argv log): srun runs its command here with SLURM_STEP_NODELIST set."""
    scen = tmp_path / "scenarios"
    scen.mkdir()
    (scen / "default.yaml").write_text("nccl: {busbw_gbps: 400}\n")
    log = tmp_path / "srun.log"
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\necho "$@" >> ' + str(log) + '\n'
                    'while [ $# -gt 0 ]; do case "$1" in\n'
                    '  --nodelist=*) SLURM_STEP_NODELIST="${1#--nodelist=}"; export SLURM_STEP_NODELIST;;\n'
                    '  -*) ;;\n  *) break;;\nesac; shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    stub = install_stub(str(tmp_path / "bin"), str(scen))
    return JobSpec(partition=None, gpus_per_node=1, binary=str(stub), mpi="pmi2"), scen, str(srun), log


def test_the_step_runs_the_sweeps_nccl_tests_command_with_the_preflights_sizes():
    spec = JobSpec(partition=None, gpus_per_node=8, binary="/opt/nccl-tests/all_reduce_perf", mpi="pmix")
    argv = step_argv(spec, ("node1", "node2"), JOB, 7.0)
    assert argv[:10] == ["srun", "--overlap", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8",
                         "--nodelist=node1,node2", "--mpi=pmix", "--time=1", "--kill-on-bad-exit=1", "--quiet"]
    assert argv[10:] == ["/opt/nccl-tests/all_reduce_perf", "-b", "65536", "-e", "4194304", "-f", str(SIZE_FACTOR),
                         "-g", "1", "-n", "3", "-w", "5", "-c", "1"]
    # the sweep's job runs the same command line (its template's srun line), only with its own sizes
    script, _ = render_job({"nodes": 2, "binary": spec.binary, "min_bytes": "65536", "max_bytes": "4194304",
                            "step_factor": SIZE_FACTOR, "iters": 3, "mpi": "pmix", "gpus_per_node": 8})
    srun_line = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert srun_line.endswith(" ".join(nccl_tests_argv(spec, 65536, 4194304, SIZE_FACTOR, 3)))


def test_output_without_a_result_table_is_no_result_and_says_why():
    assert step_result("node2: Test NCCL failure common.cu:1005 'unhandled system error'\n", 2) == (
        None, "no result table: node2: Test NCCL failure common.cu:1005 'unhandled system error'")


def test_a_busbw_nccl_tests_prints_as_0_00_is_read_from_its_time_column():
    """nccl-tests prints bandwidths as %6.2f: a link at 20 Mbit/s reads 0.00. The pre-flight takes it from the time
    column then (nccl-tests' own formula), so the evidence of a drain is the bandwidth measured, not 0."""
    from gpuguard.nccl.parse import parse_nccl

    table = ("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   "
             "busbw #wrong\n"
             "      262144         65536     float     sum      -1   100000    0.00    0.00      0   100000    0.00    "
             "0.00      0\n"
             "   268435456      67108864     float     sum      -1   1342.2  200.00  375.00      0   1342.2  200.00  "
             "375.00      0\n")
    slow, fast = parse_nccl(table).rows
    assert row_busbw(slow, 4) == pytest.approx(262144 / 100000 / 1e3 * 1.5)  # 0.00393 GB/s
    assert row_busbw(fast, 4) == 375.0  # printed with enough digits: as printed
    line, why = step_result(table, 4)
    assert why == "" and '"busbw_gbps": [0.0039321' in line, line


def test_the_ranks_run_with_the_environment_the_rounds_are_given(site, tmp_path):
    """The NCCL preset reaches every rank of every step (srun passes the environment on): the simulated nccl-tests
    writes what each rank was started with."""
    spec, scen, srun, _log = site
    envs = tmp_path / "env"
    (scen / "default.yaml").write_text(f"nccl: {{busbw_gbps: 400, env_dir: {envs}}}\n")
    rounds = NcclTestsRounds(NODES, spec, srun=srun, env={"NCCL_BUFFSIZE": "2097152", "NCCL_DEBUG": "WARN"})
    rounds.run_round([("node1", "node2"), ("node3", "node4")], 30.0, JOB)
    seen = [json.loads(p.read_text()) for p in envs.glob("*.json")]
    assert seen and all(e.get("NCCL_BUFFSIZE") == "2097152" and e.get("NCCL_DEBUG") == "WARN"
                        for e in seen), seen  # (here every step is rank 0 of this machine: one file)
    assert "NCCL_BUFFSIZE" not in os.environ  # added to the steps only


def test_a_healthy_round_gives_every_group_its_bandwidth_and_starts_no_worker(site):
    spec, _scen, srun, log = site
    rounds = NcclTestsRounds(NODES, spec, srun=srun)
    steps = rounds.run_round([("node1", "node2"), ("node3", "node4")], 30.0, JOB)
    ms = round_measurements(steps, "pair", lambda n: 50.0, 30.0, False)
    assert [m.verdict for m in ms] == ["ok", "ok"], ms
    assert all(m.size_bytes == 4194304 and m.busbw_gbps > 50 for m in ms), ms
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and all("all_reduce_perf -b 65536 -e 4194304 -f 4" in ln for ln in lines), lines
    assert not any("gpuguard.preflight.worker" in ln for ln in lines)


@pytest.mark.slow(20)
def test_a_slow_node_is_blamed_through_the_same_isolation_as_the_torch_path(site):
    spec, scen, srun, _log = site
    (scen / "node3.yaml").write_text("nccl: {busbw_gbps: 400, slow_factor: 0.1}\n")
    measure = PoolMeasure(NcclTestsRounds(NODES, spec, srun=srun), lambda n: 80.0, time.monotonic() + 120,
                          backend="nccl-tests", iters=3, step_cap_s=30.0)
    blame = run_blame(NODES, measure, None)
    assert blame.blamed == ["node3"] and blame.exclude == ["node3"], (blame.what, blame.outcome.measurements)
    assert "node3" in blame.nodes_to_drain and "busbw" in blame.nodes_to_drain["node3"]


@pytest.mark.slow(20)
def test_a_hung_step_is_stopped_within_its_allowance_and_judged_a_hang_beside_a_quick_one(site):
    spec, scen, srun, _log = site
    (scen / "node3.yaml").write_text("nccl: {hang_s: 120}\n")
    rounds = NcclTestsRounds(NODES, spec, srun=srun)
    allowance = 20.0
    t0 = time.monotonic()
    steps = rounds.run_round([("node1", "node2"), ("node3", "node4")], allowance, JOB)
    took = time.monotonic() - t0
    ok, hung = steps
    assert ok.rc == 0 and not ok.timed_out and hung.timed_out and hung.rc is None, steps
    # the early stop: 4x the quick pair's time (at least 3 s more), well inside the allowance, then the stop itself
    assert hung.duration_s <= max(4 * ok.duration_s, ok.duration_s + LATE_MIN_S) + 1.0, (ok, hung)
    assert took < allowance, took
    ms = round_measurements(steps, "pair", lambda n: 50.0, allowance, False)
    assert ms[1].busbw_gbps == 0.0 and ms[1].error.startswith("hung: "), ms[1]


@pytest.mark.slow(15)
def test_a_round_where_every_step_hangs_ends_at_its_allowance_and_leaves_no_step_behind(site, tmp_path):
    spec, scen, srun, _log = site
    (scen / "default.yaml").write_text("nccl: {hang_s: 120}\n")
    rounds = NcclTestsRounds(NODES, spec, srun=srun)
    t0 = time.monotonic()
    steps = rounds.run_round([("node1", "node2"), ("node3", "node4")], 2.0, JOB)
    took = time.monotonic() - t0
    assert all(s.timed_out for s in steps) and took < 2.0 + STOP_GRACE_S, (steps, took)
    ms = round_measurements(steps, "all", lambda n: 50.0, 2.0, True)
    assert all(m.busbw_gbps is None and m.error.startswith("too slow to judge") for m in ms), ms
    alive = [p for p in Path("/proc").glob("[0-9]*/cmdline")
             if str(scen).encode() in _read(p) or (b"nccl_tests_stub" in _read(p) and _env_has(p, str(scen)))]
    assert alive == [], alive


@pytest.mark.slow(30)
def test_gpuguard_preflight_with_nccl_tests_blames_the_slow_node_and_names_it_for_the_job(site, tmp_path):
    spec, scen, _srun, log = site
    (scen / "node3.yaml").write_text("nccl: {busbw_gbps: 400, slow_factor: 0.1}\n")
    (tmp_path / "scontrol").write_text("#!/bin/sh\nexit 1\n")  # no topology, no cluster of anyone else's
    (tmp_path / "scontrol").chmod(0o755)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"store:\n  path: {tmp_path / 'store.db'}\nnccl:\n  preflight_backend: nccl-tests\n"
                   f"  sweep_binary: {spec.binary}\n  sweep_gpus_per_node: 1\n  sweep_mpi: pmi2\n")
    p = gpuguard("--config", str(cfg), "preflight", "--nodes", "node[1-4]", "--floor", "80", "--budget", "90",
                 "--no-drain", "--exclude-file", str(tmp_path / "exclude"),
                 env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}, timeout=120)
    assert p.returncode == 10, (p.stdout, p.stderr)
    assert "blamed node3" in p.stdout and "GPUGUARD_PREFLIGHT_EXCLUDE=node3" in p.stdout, p.stdout
    assert "workers up" not in p.stdout  # no torch worker on this path
    assert (tmp_path / "exclude").read_text() == "node3\n"
    assert all("--nodelist=" in ln and " -f 4 " in ln for ln in log.read_text().splitlines())


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:
        return b""


def _env_has(cmdline: Path, text: str) -> bool:
    try:
        return text.encode() in (cmdline.parent / "environ").read_bytes()
    except OSError:
        return False
