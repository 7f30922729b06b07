"""The pre-flight's persistent workers (gpuguard.preflight.pool, worker, protocol): the wire format and the early stop
(pure), and a real pool on this machine: worker processes importing real torch, gloo over loopback, `srun` replaced
by a script that runs the worker's command line here (what Slurm would run on each node)."""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest

from gpuguard.preflight.judge import TOO_SLOW, Step, result_line, round_measurements
from gpuguard.preflight.pool import LATE_MIN_S, WorkerPool, Run, late_after
from gpuguard.preflight.protocol import LineReader, encode
from gpuguard.preflight.runner import PoolMeasure, late_verdicts


def test_lines_are_read_whole_across_reads_and_garbage_is_dropped():
    r = LineReader()
    data = encode({"op": "hello", "node": "node1"}) + b"not json\n" + encode({"gid": "g1", "port": 4242})
    assert r.feed(data[:7]) == []
    assert r.feed(data[7:]) == [{"op": "hello", "node": "node1"}, {"gid": "g1", "port": 4242}]
    assert r.feed(b"[1, 2]\n") == []  # not an object


def test_a_group_is_late_after_four_times_the_quickest_run_of_its_size_and_never_without_one():
    done = Run(("a", "b"), "g1", 0.0, result={"sizes": [1], "busbw_gbps": [1.0]}, ended_s=2.0)
    assert late_after(("c", "d"), [done], {}) == 8.0
    assert late_after(("c", "d"), [], {2: 0.2}) == 0.2 + LATE_MIN_S  # an earlier round's pair: at least 3 s more
    assert late_after(("a", "b", "c"), [done], {}) == float("inf")  # nothing of its size: the allowance decides


def test_a_stop_is_a_hang_beside_an_earlier_rounds_quick_run_and_too_slow_to_judge_without_one():
    hung = Step(("node3", "node1"), "", None, True, 3.3)
    [m] = round_measurements([hung], "confirm", lambda n: 0.01, 10.0, False, quickest={2: 0.3})
    assert m.busbw_gbps == 0.0 and m.error.startswith("hung: no result within 3.3s, a run beside it took 0.3s")
    [m] = round_measurements([hung], "confirm", lambda n: 0.01, 10.0, False)
    assert m.busbw_gbps is None and m.error.startswith(TOO_SLOW)
    cut = Step(("node3", "node1"), "", None, True, 10.0)
    [m] = round_measurements([cut], "confirm", lambda n: 0.01, 10.0, True, quickest={2: 0.3})
    assert m.busbw_gbps is None and "budget ran out" in m.error  # the budget stopped it: never evidence


def test_a_run_under_its_floor_while_its_ranks_waited_for_a_cpu_is_too_slow_to_judge_not_slow():
    def judge(starved):
        step = Step(("node1", "node2"), result_line([262144], [0.004], "gloo", 2, starved), 0, False, 0.5)
        return round_measurements([step], "pair", lambda n: 0.005, 10.0, False)[0]

    m = judge(0.6)
    assert m.busbw_gbps is None and m.error.startswith(TOO_SLOW) and "waited for a CPU 60%" in m.error
    assert judge(0.05).verdict == "slow"  # waiting on the network is sleep, not a run queue: a slow link
    assert judge(None).verdict == "slow"  # the kernel did not say: judged on bandwidth alone


@pytest.fixture
def fake_srun(tmp_path):
    """`srun --overlap -N1 -n1 -w NODE --quiet CMD...` -> CMD here (every "node" on this machine's loopback)."""
    p = tmp_path / "srun"
    p.write_text('#!/bin/sh\nshift 6\nexec "$@"\n')
    p.chmod(0o755)
    return str(p)


@pytest.mark.slow(25)  # two torch imports
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="CPU PyTorch not installed (make torch)")
def test_real_workers_run_rounds_and_a_frozen_one_is_judged_hung_within_seconds(fake_srun):
    nodes = ["n1", "n2"]
    pool = WorkerPool(nodes, "n1", {n: "127.0.0.1" for n in nodes}, srun=fake_srun)
    try:
        pool.wait_up(time.monotonic() + 120)
        assert sorted(pool.up()) == nodes and late_verdicts(pool) == {}, {n: w.gone for n, w in pool.workers.items()}
        measure = PoolMeasure(pool, lambda n: None, time.monotonic() + 60, max_bytes=65536, iters=1)
        for stage in ("all", "pair"):  # the same workers, round after round
            [m] = measure([("n1", "n2")], stage)
            assert m.verdict == "ok" and m.busbw_gbps > 0, m
        os.kill(pool.workers["n2"].proc.pid, signal.SIGSTOP)  # the worker itself: it takes no more work
        t0 = time.monotonic()
        [hung] = measure([("n2", "n1")], "confirm")
        took = time.monotonic() - t0
        assert hung.busbw_gbps == 0.0 and hung.error.startswith("hung: "), hung
        assert took < 4 * measure.quickest[2] + LATE_MIN_S + 2, took  # the early stop, not the allowance
    finally:
        for w in pool.workers.values():
            try:
                os.kill(w.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        pool.close()
