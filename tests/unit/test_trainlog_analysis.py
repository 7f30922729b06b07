"""Training-log analysis: what is critical (NaN or missing loss, NaN iterations, NaN grad norm, skipped steps once
training runs, framework NaN checks), grad-norm spikes against the run's own median, throughput per sample, on
real logs (tests/fixtures/trainlog/README.md) and synthetic ones in the frameworks' exact formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.trainlog import Thresholds, analyze, parse_log, scan_log

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "trainlog"


def run(name, th=None):
    log = scan_log((FIX / name).read_text().splitlines())
    return analyze(log.records, th, log.events, log.duplicates)


def run_lines(text_lines, th=None):
    log = scan_log(text_lines)
    return analyze(log.records, th, log.events, log.duplicates)


def kinds(a):
    return [f.kind for f in a.flags]


def megatron(it, loss=5.0, grad=1.0, ms=800.0, batch=None, skipped=0, nan=0, scale=1.0):
    s = f" iteration {it:8d}/{100000:8d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000000E-04 |"
    if batch is not None:
        s += f" global batch size: {batch:5d} |"
    if loss is not None:
        s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {scale:.1f} |"
    if grad is not None:
        s += f" grad norm: {grad:.3f} |"
    return s + f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |"


# --------------------------------------------------------------------------- critical: NaN, missing, skipped


def test_real_nan_run_without_loss_is_critical_not_a_high_grad_norm():
    a = run("megatron_deepspeed_issue396_nan.log")
    assert [(f.kind, f.severity, f.iteration, f.last_iteration, f.count) for f in a.flags] == [
        ("grad_norm_nonfinite", "critical", 5426, 5428, 3), ("loss_missing", "critical", 5426, 5428, 3)]
    assert a.critical and a.loss_first is None


def test_nan_grad_norm_is_critical_even_with_an_absolute_ceiling_set():
    a = run_lines([megatron(i, grad=1.0) for i in range(1, 6)] + [megatron(6, grad=float("nan"))],
                  Thresholds(grad_norm_max=100))
    assert kinds(a) == ["grad_norm_nonfinite"] and a.flags[0].severity == "critical"


def test_printed_nan_loss_and_nan_iterations():
    a = run_lines([megatron(10), megatron(20, loss=float("nan")), megatron(30, loss=None, skipped=1, nan=1),
                   megatron(40)])
    assert [(f.kind, f.iteration) for f in a.flags] == [("nan_loss", 20), ("nan_iterations", 30)]
    assert a.nan_iterations == 1 and all(f.severity == "critical" for f in a.flags)


def test_missing_loss_on_an_moe_line_with_its_auxiliary_losses_still_printed():
    real = (FIX / "megatron_bridge_issue4024_mtp.log").read_text().splitlines()
    nan = real[2].replace("lm loss: 8.641004E-01 | ", "").replace("iteration       31/", "iteration       32/")
    a = run_lines(real + [nan])
    assert [(f.kind, f.iteration) for f in a.flags] == [("loss_missing", 32)]


def test_fp16_skips_only_matter_once_training_runs():
    a = run("synthetic_fp16_skips.log")
    # the scaler calibrating from 2^32 (10..30) and one overflow at 150 are normal; 260-280 all skipped is not
    assert [(f.kind, f.severity, f.iteration, f.last_iteration) for f in a.flags] == [
        ("skipped_iterations", "critical", 260, 280)]
    assert a.skipped_iterations == 61
    bf16 = run_lines([megatron(10), megatron(20, loss=4.9, skipped=1, scale=1.0), megatron(30)])
    assert kinds(bf16) == ["skipped_iterations"]  # loss scale 1: nothing left to back off


# --------------------------------------------------------------------------- framework messages


def test_real_framework_nan_checks_without_any_progress_line():
    a = run("nemo_issue14348_rerun_nan.log")
    assert a.records == 0 and [(f.kind, f.severity) for f in a.flags] == [("nan_check", "critical")]
    assert "dcfai-xe9680-01" in a.flags[0].message
    assert kinds(run("pai_megatron_issue366_assert.log")) == ["nan_check"]


def test_one_check_on_many_ranks_is_one_finding_naming_the_nodes():
    msg = "found NaN in local grad norm for bucket #0 in backward pass before data-parallel communication collective"
    text = [megatron(1), *(f"[rank{r}]: RuntimeError: Rank {r}, node gpu-{r // 8:02d}, device {r % 8}, iteration 2: "
                           f"Unexpected result nan (message='{msg}')" for r in range(16))]
    a = run_lines(text)
    assert len(a.flags) == 1 and a.flags[0].count == 16 and a.flags[0].iteration == 2
    assert "on 16 ranks (nodes gpu-00, gpu-01)" in a.flags[0].message


def test_rerun_diagnosis_names_the_gpu_that_first_computed_the_result():
    a = run("synthetic_megatron_rerun.log")
    assert [(f.kind, f.severity) for f in a.flags] == [("nan_check", "critical"), ("rerun_diagnosis", "critical")]
    assert "gpu-a17 GPU 6" in a.flags[1].message  # not gpu-b02, where the rerun ran
    assert a.restarts == []  # the resume came before any new progress line


def test_deepspeed_overflows_are_counted_and_the_loss_scale_floor_is_critical():
    ovf = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"
    a = run_lines([ovf, ovf, "step=1 loss=3.0", "step=2 loss=2.9"])
    assert a.overflows == 2 and a.flags == []
    a = run_lines(["step=1 loss=3.0", "Current loss scale already at minimum - cannot decrease scale anymore. Exiting"])
    assert [(f.kind, f.severity, f.iteration) for f in a.flags] == [("loss_scale_min", "critical", 1)]


# --------------------------------------------------------------------------- grad norm against its own history


def test_grad_norm_spike_is_relative_to_the_run():
    small = [f"step={i} loss=2.0 grad_norm={0.3 + 0.01 * (i % 5):.2f}" for i in range(1, 41)]
    small[30] = "step=31 loss=2.0 grad_norm=1.5"  # 5x its median, far below any fixed 100
    a = run_lines(small)
    assert [(f.kind, f.iteration) for f in a.flags] == [("grad_norm_spike", 31)]
    big = [f"step={i} loss=2.0 grad_norm={1000 + 40 * (i % 5)}" for i in range(1, 41)]
    big[30] = "step=31 loss=2.0 grad_norm=1500"  # within this run's normal range
    assert run_lines(big).flags == []
    big[30] = "step=31 loss=2.0 grad_norm=6000"
    assert kinds(run_lines(big)) == ["grad_norm_spike"]


def test_grad_norm_spike_needs_history_and_restarts_with_each_attempt():
    few = [f"step={i} loss=2.0 grad_norm=0.3" for i in range(1, 6)] + ["step=6 loss=2.0 grad_norm=5"]
    assert run_lines(few).flags == []  # 5 values are no baseline
    huge = run("bigscience_tr8_104b.log")  # grad norms of 1e4-1e5 throughout: that run's normal, not a finding
    assert "grad_norm_spike" not in kinds(huge) and "grad_norm_high" not in kinds(huge)
    assert kinds(run("bigscience_tr8_104b.log", Thresholds(grad_norm_max=1e5))).count("grad_norm_high") == 2


# --------------------------------------------------------------------------- throughput


def test_batch_size_ramp_is_not_a_slowdown_but_the_same_times_without_batch_sizes_are():
    ramp = [megatron(i * 10, batch=b, ms=3.3 * b * (1 + 0.01 * (i % 3))) for i, b in
            enumerate([64] * 10 + [128] * 10 + [192] * 10 + [256] * 10, 1)]
    a = run_lines(ramp)
    assert a.flags == [] and a.throughput_unit == "s/sample"
    blind = run_lines([megatron(i * 10, ms=3.3 * b) for i, b in enumerate([64] * 10 + [128] * 10, 1)])
    assert kinds(blind) == ["throughput_drop"] and blind.throughput_unit == "s/iteration"


def test_one_slow_iteration_is_not_a_drop_a_sustained_one_is():
    times = [0.50 + 0.01 * (i % 3) for i in range(40)]
    times[20] = 2.5  # a checkpoint save
    assert run_lines([f"step={i} loss=2.0 step_time={t}" for i, t in enumerate(times, 1)]).flags == []
    times[25:] = [0.8] * 15  # a slow node from step 26 on
    a = run_lines([f"step={i} loss=2.0 step_time={t}" for i, t in enumerate(times, 1)])
    assert [(f.kind, f.iteration, f.last_iteration) for f in a.flags] == [("throughput_drop", 26, 40)]
    assert "still slow at the end of the log" in a.flags[0].message and "36%" in a.flags[0].message


def test_torchtitan_throughput_is_judged_per_token():
    a = run("torchtitan_pr3393.log")
    assert a.throughput_unit == "s/token" and a.flags == []


# --------------------------------------------------------------------------- the complete synthetic run


def test_synthetic_megatron_run_with_every_fault():
    a = run("synthetic_gpt_run.log")
    assert a.records == 310 and (a.first_iteration, a.last_iteration) == (10, 3000) and a.restarts == [2810]
    got = [(f.kind, f.severity, f.iteration, f.last_iteration) for f in a.flags]
    assert got == [("grad_norm_nonfinite", "critical", 1200, 1200), ("loss_missing", "critical", 1200, 1200),
                   ("loss_spike", "warning", 1800, 1820), ("grad_norm_spike", "warning", 2200, 2210),
                   ("throughput_drop", "warning", 2600, 2750)]
    # the 4x slower interval at 2500 and the batch-size ramp (64 -> 256 per iteration) raise nothing
    assert a.throughput_unit == "s/sample" and a.throughput_median == pytest.approx(0.0033, rel=0.05)


# --------------------------------------------------------------------------- the other real logs


def test_healthy_real_logs_raise_nothing():
    for name in ("megatron_lm_pai604.log", "megatron_bridge_issue4024_mtp.log", "torchtitan_pr3393.log",
                 "torchtitan_pr2389_ranks.log", "nanotron_issue390.log", "nanotron_pr23.log",
                 "hf_trainer_pr35207.log", "lightning_issue4225.log", "lightning_issue3866.log",
                 "bigscience_tr11_200b_deepspeed.log"):
        a = run(name)
        assert a.flags == [] and a.records > 0, (name, a.flags)


def test_real_hf_nan_grad_norm():
    a = run("hf_trainer_issue233_nan.log")
    assert [(f.kind, f.severity, f.count) for f in a.flags] == [("grad_norm_nonfinite", "critical", 3)]


def test_real_tr1_13b_loss_spike_and_zero_grad_norm():
    a = run("bigscience_tr1_13b_spike.log")
    spike = next(f for f in a.flags if f.kind == "loss_spike")
    # the loss jumped from ~2.77 to 7.34 at 29050 and peaked at 8.72 at 29060 (BigScience's chronicles)
    assert spike.iteration == 29050 and spike.value == pytest.approx(8.715872) and "29060" in spike.message
    zero = next(f for f in a.flags if f.kind == "grad_norm_zero")
    assert (zero.iteration, zero.last_iteration) == (29020, 29090) and "every line" in zero.message
    assert not a.critical


def test_real_tr8_104b_restart_and_spike_in_the_rerun():
    a = run("bigscience_tr8_104b.log")
    assert a.restarts == [6900]  # the rerun from global_step6210 appends to the same story
    assert [(f.kind, f.iteration, f.last_iteration) for f in a.flags] == [("loss_spike", 6930, 6940)]
    early = analyze(parse_log((FIX / "bigscience_tr8_104b.log").read_text().splitlines()), Thresholds(min_history=1))
    assert any(f.kind == "loss_spike" and f.iteration == 7010 for f in early.flags)


# --------------------------------------------------------------------------- learning rate


def test_key_value_log_lr_stuck_at_zero_and_zero_grad():
    a = run("kv_run.log")
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


# --------------------------------------------------------------------------- issue 16: live logs, short logs, skips


def test_a_cut_last_line_is_not_judged():
    """A log being written (or an excerpt) ends inside a Megatron line: that line used to be a CRITICAL
    "loss missing"; it is skipped and counted, the complete lines are judged."""
    log = scan_log((FIX / "megatron_llm_issue11_cut.log").read_text().splitlines())
    a = analyze(log.records, None, log.events, log.duplicates, log.incomplete)
    assert (a.records, a.last_iteration, a.incomplete) == (4, 125, 1)
    assert a.flags == [] and not a.critical


def test_a_line_wrapped_by_a_document_is_joined():
    wrapped = run("megatron_llm_issue11_wrapped.log")
    whole = run_lines((FIX / "megatron_llm_issue11_cut.log").read_text().splitlines()[:4])
    assert wrapped.records == whole.records == 4 and wrapped.flags == []
    assert (wrapped.loss_first, wrapped.loss_last, wrapped.grad_norm_max) == \
        (whole.loss_first, whole.loss_last, whole.grad_norm_max) == (2.50422, 2.477393, 0.356)


def test_a_line_cut_in_a_file_that_is_still_being_written(tmp_path):
    """Formats without an end marker of their own (key=value, torchtitan): a last line without its newline is
    not judged (`step=3 loss=9` could be `step=3 loss=9.1` a moment later)."""
    from gpuguard.trainlog.cli import iter_lines

    f = tmp_path / "live.log"
    f.write_text("step=1 loss=3.0\nstep=2 loss=2.9\nstep=3 loss=9")
    log = scan_log(iter_lines(str(f)))
    assert [r.iteration for r in log.records] == [1, 2] and log.incomplete == 1
    f.write_text("step=1 loss=3.0\nstep=2 loss=2.9\nstep=3 loss=9.1\n")
    assert [r.iteration for r in scan_log(iter_lines(str(f))).records] == [1, 2, 3]


def test_a_1000x_grad_norm_jump_in_a_short_log_is_flagged():
    """unsloth#5207: 9 records, grad norm 11140 after values of 5-30; the trailing-window rule needs 10 records of
    history, the ceiling relative to the run's first grad norms does not. The 9x bump at step 4 is not flagged."""
    a = run("unsloth_issue5207_grad_spike.log")
    assert [(f.kind, f.severity, f.iteration) for f in a.flags] == [("grad_norm_spike", "warning", 9)]
    assert "744x the run's first grad norms" in a.flags[0].message


def test_deepspeed_overflows_in_a_row_once_training_runs_are_critical():
    """Chinese-LLaMA-Alpaca#534: at step 378 of 2724 the loss scale goes 64 -> 32 -> ... -> 2, one skipped step
    after another (it then died at the scaler's minimum): flagged. DeepSpeed#931: the same kind of streak while
    the scaler calibrates from 65536 at the start: normal, not flagged."""
    a = run("deepspeed_issue534_overflow_streak.log")
    assert [(f.kind, f.severity, f.count) for f in a.flags] == [("skip_streak", "critical", 5)]
    assert "5 optimizer steps skipped in a row" in a.flags[0].message and "64 -> 2" in a.flags[0].message
    warmup = run("deepspeed_issue931_warmup.log")
    assert warmup.overflows == 4 and warmup.flags == []
    # below the threshold once under way: an overflow or two now and then is normal
    ovf = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {}, reducing to {}"
    few = ["step=1 loss=3.0", ovf.format(65536, 32768), ovf.format(32768, 16384), "step=2 loss=2.9"]
    assert run_lines(few).flags == []
    many = ["step=1 loss=3.0"] + [ovf.format(2 ** (16 - i), 2 ** (15 - i)) for i in range(4)]
    assert kinds(run_lines(many)) == ["skip_streak"]


def test_megatron_skips_in_consecutive_intervals_once_training_runs_are_critical():
    warm = [megatron(10, loss=None, skipped=10, scale=2 ** 20), megatron(20, skipped=3, scale=2 ** 17)]
    normal = [megatron(10 * i, scale=2 ** 17) for i in range(3, 8)]
    falling = [megatron(80, skipped=2, scale=2 ** 15), megatron(90, skipped=2, scale=2 ** 13),
               megatron(100, skipped=1, scale=2 ** 12)]
    assert run_lines(warm + normal).flags == []
    a = run_lines(warm + normal + falling)
    assert [(f.kind, f.iteration, f.last_iteration) for f in a.flags] == [("skip_streak", 80, 100)]
