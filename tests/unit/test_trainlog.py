"""Training-log analysis on real Megatron logs (tests/fixtures/trainlog, sources in each file's header) and a
realistic synthetic run with an injected NaN, loss spike and slow interval."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.trainlog import Thresholds, analyze, parse_line, parse_log

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "trainlog"


def records(name):
    return parse_log((FIX / name).read_text().splitlines())


def kinds(analysis):
    return [f.kind for f in analysis.flags]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gpuguard", "trainlog", *args], capture_output=True, text=True,
                          timeout=60)


# --------------------------------------------------------------------------- parsing


def test_megatron_line_fields():
    r = parse_line(" [2026-09-11 12:07:17.375194] iteration        4/ 7629408 | consumed samples:          128 | "
                   "elapsed time per iteration (ms): 24386.9 | throughput per GPU (TFLOP/s/GPU): 26.8 | learning "
                   "rate: 1.875000E-04 | global batch size:    32 | lm loss: 1.044366E+01 | loss scale: 1.0 | grad "
                   "norm: 4.157 | num zeros: 871.0 | number of skipped iterations:   0 | number of nan iterations:   0 |")
    assert r is not None
    assert (r.iteration, r.total, r.fmt) == (4, 7629408, "megatron")
    assert r.loss == pytest.approx(10.44366) and r.lr == pytest.approx(1.875e-4)
    assert r.grad_norm == pytest.approx(4.157) and r.iter_time_s == pytest.approx(24.3869)
    assert r.nan_iterations == 0 and r.timestamp == "2026-09-11 12:07:17.375194"


def test_prefixes_seconds_and_colonless_forms():
    torchrun = parse_line("[default7]: [2026-09-08 20:31:37] iteration      561/ 7629408 | lm loss: 4.858129E-02 |")
    srun = parse_line("7:  iteration        4/   30517 | consumed samples:           64 | lm loss: 1.1E+01 |")
    ds = records("bigscience_tr11_200b_deepspeed.log")[0]
    old = parse_line(" iteration      100/     500 | elapsed time per iteration (ms): 300.0 | learning rate 1.500E-04 | "
                     "lm loss 6.512345E+00 | loss scale 4096.0 |")
    assert torchrun.iteration == 561 and torchrun.loss == pytest.approx(0.04858129)
    assert srun.iteration == 4
    assert ds.iter_time_s == pytest.approx(769.99)  # "(s)": seconds, not ms
    assert old.loss == pytest.approx(6.512345) and old.lr == pytest.approx(1.5e-4)


def test_nan_and_inf_as_megatron_prints_them():
    # Megatron formats the loss with {:.6E}: a NaN prints as NAN, an infinity as INF
    r = parse_line(" iteration       30/    1000 | lm loss: NAN | grad norm: nan | number of nan iterations:   1 |")
    assert math.isnan(r.loss) and math.isnan(r.grad_norm) and r.nan_iterations == 1
    assert math.isinf(parse_line(" iteration 5/ 9 | lm loss: -INF |").loss)


def test_not_iteration_lines():
    for line in (" validation loss at iteration 50 | lm loss value: 8.889540E+00 | lm loss PPL: 7.255679E+03 |",
                 "saving checkpoint at iteration     100 to /ckpt in torch_dist format",
                 "[Rank 0] (after 10 iterations) memory (MB) | allocated: 1464.3 | max allocated: 1464.3",
                 "export STEP=3", "step=4 note=checkpoint-saved", "", "iteration iteration | |"):
        assert parse_line(line) is None, line


def test_key_value_format_and_units():
    r = parse_line("rank0 step=120 loss=2.31 grad_norm=0.9 lr=3e-4 step_time=510ms")
    assert (r.iteration, r.fmt, r.loss, r.grad_norm, r.lr) == (120, "kv", 2.31, 0.9, 3e-4)
    assert r.iter_time_s == pytest.approx(0.51)
    assert parse_line("iter=7 train_loss=nan time_ms=812").iter_time_s == pytest.approx(0.812)


def test_garbage_never_raises():
    for line in ("iteration 99999999999999999999/1 | lm loss: 1e999999 |", "step=abc loss=1", "\x00\xff" * 50,
                 " iteration 1/ 2 | lm loss: 1.0E+ | grad norm: -- |", "step=1 loss=1.0=2"):
        parse_line(line)


# --------------------------------------------------------------------------- real logs


def test_real_tr1_13b_loss_spike_and_zero_grad_norm():
    a = analyze(records("bigscience_tr1_13b_spike.log"))
    spike = next(f for f in a.flags if f.kind == "loss_spike")
    # the loss jumped from ~2.77 to 7.34 at 29050 and peaked at 8.72 at 29060 (BigScience's chronicles)
    assert spike.iteration == 29050 and spike.value == pytest.approx(8.715872)
    assert "29060" in spike.message
    zero = next(f for f in a.flags if f.kind == "grad_norm_zero")
    assert (zero.iteration, zero.last_iteration) == (29020, 29090)
    assert "nan_loss" not in kinds(a)


def test_real_tr8_104b_restart_spike_and_huge_grad_norms():
    recs = records("bigscience_tr8_104b.log")
    a = analyze(recs)
    assert a.restarts == [6900]  # the rerun from global_step6210 appends to the same story
    spikes = [f for f in a.flags if f.kind == "loss_spike"]
    assert [(f.iteration, f.last_iteration) for f in spikes] == [(6930, 6940)]
    assert sum(f.kind == "grad_norm_high" for f in a.flags) == 2  # one episode per attempt, not one per line
    # with a single record of history, the first experiment's 6.44 -> 11.42 jump is caught too
    early = analyze(recs, Thresholds(min_history=1))
    assert any(f.kind == "loss_spike" and f.iteration == 7010 for f in early.flags)


def test_healthy_real_lines_raise_nothing_but_the_grad_norm():
    a = analyze(records("bigscience_tr11_200b_deepspeed.log"), Thresholds(grad_norm_max=1e6))
    assert a.flags == []


# --------------------------------------------------------------------------- the realistic run with faults


def test_synthetic_run_with_injected_nan_spike_and_slow_interval():
    a = analyze(records("synthetic_gpt_run.log"))
    assert a.records == 300 and (a.first_iteration, a.last_iteration) == (10, 3000)
    by_kind = {f.kind: f for f in a.flags}
    assert set(by_kind) == {"nan_loss", "loss_spike", "iter_time_spike"}, a.flags
    assert by_kind["nan_loss"].iteration == 1200 and by_kind["nan_loss"].severity == "critical"
    assert (by_kind["loss_spike"].iteration, by_kind["loss_spike"].last_iteration) == (1800, 1820)
    assert by_kind["iter_time_spike"].iteration == 2500
    assert a.loss_last < 2.5 and 0.8 < a.iter_time_median_s < 0.9


def test_key_value_log_lr_stuck_at_zero_and_zero_grad():
    a = analyze(records("kv_run.log"))
    assert {f.kind for f in a.flags} == {"lr_zero", "grad_norm_zero"}
    assert next(f for f in a.flags if f.kind == "grad_norm_zero").iteration == 4


def test_lr_pinned_at_max_after_warmup():
    warmup = [f"step={i} loss=3.0 lr={3e-4 * i / 5:.6g}" for i in range(1, 6)]
    pinned = [f"step={i} loss={3 - i * 0.01:.3f} lr=3e-4" for i in range(6, 31)]
    assert "lr_stuck_max" in kinds(analyze(parse_log(warmup + pinned)))
    decaying = [f"step={i} loss=3.0 lr={3e-4 * (1 - i / 40):.6g}" for i in range(6, 31)]
    assert "lr_stuck_max" not in kinds(analyze(parse_log(warmup + decaying)))
    # a constant schedule from the first step is a choice, not a fault
    assert "lr_stuck_max" not in kinds(analyze(parse_log(pinned)))


def test_one_warmup_record_at_lr_zero_is_normal():
    a = analyze(parse_log([f"step={i} loss=3.0 lr={0 if i == 1 else 1e-4}" for i in range(1, 10)]))
    assert a.flags == []


# --------------------------------------------------------------------------- CLI


def test_cli_summary_json_and_exit_codes(tmp_path):
    p = run_cli(str(FIX / "synthetic_gpt_run.log"))
    assert p.returncode == 1
    assert "CRITICAL nan_loss" in p.stdout and "iteration 1200" in p.stdout
    j = run_cli(str(FIX / "synthetic_gpt_run.log"), "--json")
    data = json.loads(j.stdout)  # valid JSON although values are NaN
    assert j.returncode == 1 and data["records"] == 300
    assert {f["kind"] for f in data["flags"]} == {"nan_loss", "loss_spike", "iter_time_spike"}
    clean = tmp_path / "clean.log"
    clean.write_text("\n".join(f"step={i} loss={5 - i * 0.01:.3f} lr=1e-4 step_time=0.5" for i in range(1, 50)))
    assert run_cli(str(clean)).returncode == 0


def test_cli_bad_input_is_a_clear_error(tmp_path):
    missing = run_cli(str(tmp_path / "nope.log"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    empty = tmp_path / "empty.log"
    empty.write_text("hello\nworld\n")
    p = run_cli(str(empty))
    assert p.returncode == 2 and "no training iteration lines" in p.stderr
    assert run_cli(str(empty), "--spike-ratio", "-1").returncode == 2


def test_cli_plot_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (optional extra gpuguard[plot])")
    out = tmp_path / "run.png"
    p = run_cli(str(FIX / "synthetic_gpt_run.log"), "--plot", str(out))
    assert p.returncode == 1 and "plot written" in p.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
