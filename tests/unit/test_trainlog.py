"""Training-log parsing: one parser per framework, checked on real published lines (tests/fixtures/trainlog,
sources in its README.md), the frameworks' own NaN-check and resume messages, and how a whole log is split into
one rank's copy and resumed attempts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpuguard.monitor.progress import LogFollower
from gpuguard.trainlog import parse_line, parse_log, scan_log
from gpuguard.trainlog.events import parse_event

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "trainlog"


def lines(name):
    return (FIX / name).read_text().splitlines()


# --------------------------------------------------------------------------- Megatron-LM / Megatron-DeepSpeed


def test_megatron_line_fields():
    r = parse_line(" [2026-09-11 12:07:17.375194] iteration        4/ 7629408 | consumed samples:          128 | "
                   "elapsed time per iteration (ms): 24386.9 | throughput per GPU (TFLOP/s/GPU): 26.8 | learning "
                   "rate: 1.875000E-04 | global batch size:    32 | lm loss: 1.044366E+01 | loss scale: 1.0 | grad "
                   "norm: 4.157 | num zeros: 871.0 | number of skipped iterations:   0 | "
                   "number of nan iterations:   0 |")
    assert r is not None
    assert (r.iteration, r.total, r.fmt, r.batch_size, r.loss_scale) == (4, 7629408, "megatron", 32, 1.0)
    assert r.loss == pytest.approx(10.44366) and r.loss_key == "lm loss" and r.lr == pytest.approx(1.875e-4)
    assert r.grad_norm == pytest.approx(4.157) and r.iter_time_s == pytest.approx(24.3869)
    assert r.nan_iterations == 0 and r.skipped_iterations == 0 and r.timestamp == "2026-09-11 12:07:17.375194"


def test_real_megatron_lm_lines_with_throughput_and_memory_report():
    recs = parse_log(lines("megatron_lm_pai604.log"))  # the "[Rank 0] (after 1 iterations) memory" line is not one
    assert [r.iteration for r in recs] == [1, 2, 3]
    assert recs[1].iter_time_s == pytest.approx(3.5118) and recs[1].batch_size == 32
    assert recs[2].grad_norm == pytest.approx(308.51) and recs[2].loss == pytest.approx(20.97394)


def test_real_nan_line_has_no_loss_and_a_nan_grad_norm():
    # Megatron-DeepSpeed issue #396: "I do not find loss in the logs" -- the NaN average is simply not printed
    recs = parse_log(lines("megatron_deepspeed_issue396_nan.log"))
    assert [r.iteration for r in recs] == [5426, 5427, 5428]
    assert all(r.loss is None and r.losses == {} and math.isnan(r.grad_norm) for r in recs)
    assert recs[0].batch_size == 8 and recs[0].nan_iterations == 0


def test_auxiliary_losses_never_stand_in_for_the_lm_loss():
    r = parse_log(lines("megatron_bridge_issue4024_mtp.log"))[0]
    assert r.loss_key == "lm loss" and r.loss == pytest.approx(0.8716962)
    assert set(r.losses) == {"lm loss", "seq_load_balancing_loss", "mtp_1 loss", "mtp_2 loss"}
    # the same line with a NaN lm loss: Megatron drops "lm loss", the MoE/MTP losses stay
    nan_line = lines("megatron_bridge_issue4024_mtp.log")[0].replace("lm loss: 8.716962E-01 | ", "")
    r = parse_line(nan_line)
    assert r.loss is None and r.loss_key is None and "mtp_1 loss" in r.losses


def test_all_skipped_interval_prints_a_zero_average_that_is_not_a_loss():
    r = parse_line(" iteration       30/    1000 | lm loss: 0.000000E+00 | loss scale: 4194304.0 | "
                   "number of skipped iterations:  10 | number of nan iterations:   0 |")
    assert r.loss is None and r.skipped_iterations == 10 and r.loss_scale == 4194304.0


def test_prefixes_seconds_and_colonless_forms():
    torchrun = parse_line("[default7]: [2026-09-08 20:31:37] iteration      561/ 7629408 | lm loss: 4.858129E-02 |")
    srun = parse_line("7:  iteration        4/   30517 | consumed samples:           64 | lm loss: 1.1E+01 |")
    ds = parse_log(lines("bigscience_tr11_200b_deepspeed.log"))[0]
    old = parse_line(" iteration      100/     500 | elapsed time per iteration (ms): 300.0 | "
                     "learning rate 1.500E-04 | lm loss 6.512345E+00 | loss scale 4096.0 |")
    assert torchrun.iteration == 561 and torchrun.loss == pytest.approx(0.04858129) and torchrun.source == "rank 7"
    assert srun.iteration == 4 and srun.source == "rank 7"
    assert ds.iter_time_s == pytest.approx(769.99)  # "(s)": seconds, not ms
    assert old.loss == pytest.approx(6.512345) and old.lr == pytest.approx(1.5e-4)


def test_nan_and_inf_as_megatron_prints_them():
    r = parse_line(" iteration       30/    1000 | lm loss: NAN | grad norm: nan | number of nan iterations:   1 |")
    assert math.isnan(r.loss) and math.isnan(r.grad_norm) and r.nan_iterations == 1
    assert math.isinf(parse_line(" iteration 5/ 9 | lm loss: -INF |").loss)


def test_not_iteration_lines():
    for line in (" validation loss at iteration 50 | lm loss value: 8.889540E+00 | lm loss PPL: 7.255679E+03 |",
                 "saving checkpoint at iteration     100 to /ckpt in torch_dist format",
                 "[Rank 0] (after 10 iterations) memory (MB) | allocated: 1464.3 | max allocated: 1464.3",
                 "export STEP=3", "step=4 note=checkpoint-saved", "", "iteration iteration | |",
                 "{'eval_loss': 1.2, 'eval_runtime': 3.1, 'epoch': 1.0}",
                 "{'train_runtime': 120.5, 'train_samples_per_second': 9.1, 'train_loss': 1.4, 'epoch': 3.0}",
                 "Epoch 0:   0%|          | 0/18 [00:00<?, ?it/s]",
                 "[titan] 2026-02-24 19:50:00,000 - root - INFO - validate step: 100  loss:  2.10000  memory: 1GiB"):
        assert parse_line(line) is None, line


# --------------------------------------------------------------------------- nanotron, torchtitan, HF, Lightning


def test_real_nanotron_lines_in_human_format():
    r = parse_log(lines("nanotron_issue390.log"))[0]
    assert (r.fmt, r.iteration, r.total, r.batch_size) == ("nanotron", 327281, 378950, 64)
    assert r.iter_time_s == pytest.approx(11.5)  # "elapsed_time_per_iteration_ms: 11.5K"
    assert r.loss == pytest.approx(2.38) and r.lr == pytest.approx(1e-5) and r.grad_norm == pytest.approx(1.25)
    assert r.tokens_per_s == pytest.approx(22800)
    r = parse_log(lines("nanotron_pr23.log"))[1]
    assert r.iteration == 992 and r.iter_time_s == pytest.approx(0.268) and r.tokens_per_s == pytest.approx(2390)


def test_real_torchtitan_lines():
    recs = parse_log(lines("torchtitan_pr3393.log"))
    assert [r.iteration for r in recs] == list(range(14, 22))
    assert recs[0].loss == pytest.approx(3.24405) and recs[0].grad_norm == pytest.approx(0.8319)
    assert recs[0].tokens_per_s == 7282 and recs[0].source == "rank 0"


def test_torchtitan_colours_are_stripped():
    # torchtitan's log_train_step f-string with its Color escapes (red/green/orange/... and reset)
    red, green, orange, turquoise, blue, cyan, magenta, reset = (
        "\033[31m", "\033[32m", "\033[38;2;180;60;0m", "\033[38;2;54;234;195m", "\033[34m", "\033[36m", "\033[35m",
        "\033[39m")
    line = (f"[rank0]:[titan] 2026-05-18 16:04:46,338 - root - INFO - {red}step: 14  {green}loss:  3.24405  "
            f"{orange}grad_norm:    nan  {turquoise}memory:  9.46GiB(64.99%)  {blue}tps: 7,282  {cyan}tflops: 0.52  "
            f"{magenta}mfu: 0.17%{reset}")
    r = parse_line(line)
    assert r.iteration == 14 and r.loss == pytest.approx(3.24405) and math.isnan(r.grad_norm)
    assert r.tokens_per_s == 7282


def test_real_hf_trainer_dict_lines():
    recs = parse_log(lines("hf_trainer_pr35207.log"))
    assert [r.iteration for r in recs] == [1, 2, 3, 4, 5, 6]  # no step in the line: numbered in order
    assert recs[0].loss == pytest.approx(2.119) and recs[0].grad_norm == pytest.approx(37.657958984375)
    assert recs[0].lr == pytest.approx(4.5833333333333334e-05) and recs[-1].epoch == 1.5
    assert parse_line(lines("hf_trainer_pr35207.log")[0]).iteration is None  # stateless: no step to give
    nan = parse_log(lines("hf_trainer_issue233_nan.log"))
    assert all(math.isnan(r.grad_norm) for r in nan) and nan[1].loss == 0.0


def test_hf_values_wrapped_in_numpy_or_tensor_reprs():
    r = parse_line("  5%|▌         | 50/1000 [00:25<08:00]{'loss': np.float64(2.5), 'grad_norm': tensor(0.75, "
                   "device='cuda:0'), 'learning_rate': 1e-05, 'epoch': 0.05}")
    assert r.loss == 2.5 and r.grad_norm == 0.75 and r.lr == 1e-05


def test_real_lightning_progress_bars():
    log = scan_log(lines("lightning_issue4225.log"))
    # each step is drawn twice (before and after its loss is known): the later draw is kept
    assert [(r.iteration, r.loss) for r in log.records] == [(1, 10.473), (2, 10.224), (3, 10.047), (4, 9.926),
                                                            (5, 9.847)]
    assert log.records[3].iter_time_s == pytest.approx(4.47) and log.duplicates == 5
    nb = parse_log(lines("lightning_issue3866.log"))  # notebook form, no bar, a rate in it/s
    assert nb[0].iteration == 1651 and nb[0].iter_time_s == pytest.approx(1 / 2.11) and nb[0].loss == 0.158


def test_lightning_epochs_become_one_iteration_axis_and_carriage_returns_split_updates():
    bar = "Epoch {e}:  {p}%|██        | {n}/4 [00:01<00:01,  2.00it/s, loss={l}, v_num=0]"
    one_line = "\r".join(bar.format(e=e, p=25 * n, n=n, l=5 - e - n / 10) for e in (0, 1) for n in (1, 2, 3, 4))
    recs = parse_log([one_line])
    assert [r.iteration for r in recs] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert recs[-1].loss == pytest.approx(3.6) and {r.attempt for r in recs} == {0}


def test_key_value_format_and_units():
    r = parse_line("rank0 step=120 loss=2.31 grad_norm=0.9 lr=3e-4 step_time=510ms")
    assert (r.iteration, r.fmt, r.loss, r.grad_norm, r.lr) == (120, "kv", 2.31, 0.9, 3e-4)
    assert r.iter_time_s == pytest.approx(0.51)
    assert parse_line("iter=7 train_loss=nan time_ms=812").iter_time_s == pytest.approx(0.812)


def test_garbage_never_raises():
    for line in ("iteration 99999999999999999999/1 | lm loss: 1e999999 |", "step=abc loss=1", "\x00\xff" * 50,
                 " iteration 1/ 2 | lm loss: 1.0E+ | grad norm: -- |", "step=1 loss=1.0=2", "{'loss': }",
                 "Epoch 9999999999: 1/?", "iteration: 1 / 0 | lm_loss: 1.2Q |", "step: 1 loss: --", "\r\r\r"):
        parse_line(line)


# --------------------------------------------------------------------------- framework messages


def test_real_megatron_nan_check_messages():
    e = parse_event(lines("nemo_issue14348_rerun_nan.log")[0])
    assert (e.kind, e.severity, e.rank, e.node, e.iteration) == ("nan_check", "critical", 2, "dcfai-xe9680-01", None)
    assert e.detail.startswith("found NaN in local grad norm for bucket #0")
    e = parse_event(lines("pai_megatron_issue366_assert.log")[0])
    assert (e.kind, e.severity, e.rank) == ("nan_check", "critical", 11) and "GPU 3" in e.message


def test_megatron_rerun_messages_as_the_state_machine_formats_them():
    ev = [parse_event(x) for x in lines("synthetic_megatron_rerun.log")]
    kinds = [(e.kind, e.severity) for e in ev if e is not None]
    assert kinds == [("nan_check", "critical"), ("rerun_first", "info"), ("resume", "info"),
                     ("rerun_diagnosis", "critical")]
    spiky = parse_event("Unexpected result 12.5 on rank 0 at iteration #77 invocation #1 (message='Spiky loss')")
    assert (spiky.severity, spiky.iteration) == ("warning", 77)


def test_deepspeed_loss_scaler_and_resume_markers():
    ovf = parse_event("[2023-08-02 00:41:17,526] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank "
                      "0 Skipping step. Attempted loss scale: 4294967296, reducing to 2147483648")
    assert (ovf.kind, ovf.severity) == ("overflow", "info")
    floor = parse_event("Exception: Current loss scale already at minimum - cannot decrease scale anymore. "
                        "Exiting run.")
    assert (floor.kind, floor.severity) == ("loss_scale_min", "critical")
    for text, it in (("  successfully loaded checkpoint from /ckpt [ t 1/4, p 1/1 ] at iteration 2800", 2800),
                     ("[rank0]:[titan] 2026-05-18 16:04:30,000 - root - INFO - Training starts at step 11", 10),
                     ("  Continuing training from global step 500", 500)):
        e = parse_event(text)
        assert (e.kind, e.iteration) == ("resume", it)
    assert parse_event("Restoring states from the checkpoint path at /ckpt/last.ckpt").kind == "resume"
    assert parse_event("check_for_nan_in_loss_and_grad ............ True") is None


# --------------------------------------------------------------------------- whole logs


def test_other_ranks_copies_are_dropped():
    log = scan_log(lines("torchtitan_pr2389_ranks.log"))  # 7 ranks printed step 4 into one file
    assert [r.iteration for r in log.records] == [4, 5] and log.duplicates == 6
    tagged = [f"[rank{k}]:[titan] - root - INFO - step: {s}  loss:  {9 - s / 10:.5f}  grad_norm:  1.0000"
              for s in (1, 2, 3) for k in (1, 0)]
    log = scan_log(tagged)  # interleaved ranks never look like restarts
    assert [r.iteration for r in log.records] == [1, 2, 3] and log.source == "rank 1"
    assert {r.attempt for r in log.records} == {0} and log.sources == ["rank 1", "rank 0"]


def test_resumed_attempts():
    tr8 = scan_log(lines("bigscience_tr8_104b.log")).records  # iteration goes back: 7220 -> 6900
    assert [r.attempt for r in tr8].index(1) == 3 and tr8[3].iteration == 6900
    tr11 = scan_log(lines("bigscience_tr11_200b_deepspeed.log")).records  # same step, other values: a rerun
    assert [(r.iteration, r.attempt) for r in tr11] == [(2, 0), (2, 1)]
    marker = [" iteration       10/     100 | lm loss: 5.0E+00 |", " iteration       20/     100 | lm loss: 4.9E+00 |",
              "  successfully loaded checkpoint from /ckpt [ t 1/1, p 1/1 ] at iteration 20",
              " iteration       30/     100 | lm loss: 4.8E+00 |"]
    assert [r.attempt for r in parse_log(marker)] == [0, 0, 1]  # resumed exactly where it stopped: still a restart
    hf = ["{'loss': 2.0, 'epoch': 0.5}", "{'loss': 1.9, 'epoch': 1.0}", "{'loss': 1.95, 'epoch': 0.5}"]
    assert [(r.iteration, r.attempt) for r in parse_log(hf)] == [(1, 0), (2, 0), (1, 1)]


def test_monitor_follower_reads_every_format(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("")
    follower = LogFollower(str(log))
    assert follower.poll() == []
    with log.open("a") as f:
        for name in ("torchtitan_pr3393.log", "nanotron_pr23.log", "lightning_issue3866.log", "hf_trainer_pr35207.log"):
            f.write((FIX / name).read_text())
    got = follower.poll()
    assert len(got) == 8 + 3 + 14 + 6 and follower.last.fmt == "hf"
    assert follower.step_time_s() == pytest.approx(1 / 2.12, rel=0.05)
