"""Property tests: no text, however broken, makes the training-log parser, the analysis, the summary, the JSON
or the plot raise -- the monitor follows logs that users write, and a crash there loses the job's watchdog."""

from __future__ import annotations

import json
import math
import os
import tempfile

from hypothesis import example, HealthCheck, given, settings
from hypothesis import strategies as st
from propbudget import examples

from gpuguard.trainlog import Thresholds, analyze, format_summary, main_from_args, parse_line, scan_log
from gpuguard.trainlog.events import parse_event

values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10 ** 20, 10 ** 20),
                   st.sampled_from(["nan", "NAN", "-INF", "inf", "", "--", "1e999", "11.5K", "85.8G", "7,282",
                                    "np.float64(1.0)", "tensor(0.5, device='cuda:0')", "?"]))
steps = st.integers(-5, 10 ** 16)


def _e(x):
    return f"{x:.6E}" if isinstance(x, float) else str(x)


# each follows one framework's line format (see gpuguard.trainlog.formats / events), filled with hostile values
TEMPLATES = [
    lambda it, a, b, c: (f" [2026-03-02 10:00:00.000000] iteration {it:8d}/{10 ** 6:8d} | consumed samples: {c} | "
                         f"elapsed time per iteration (ms): {_e(b)} | learning rate: {_e(a)} | "
                         f"global batch size: {c} | "
                         f"lm loss: {_e(a)} | loss scale: {_e(b)} | grad norm: {_e(b)} | number of skipped iterations:"
                         f" {c} | number of nan iterations: {c} |"),
    lambda it, a, b, c: f" iteration {it:8d}/{it:8d} | loss scale: {b} | grad norm: {b} |",
    lambda it, a, b, c: (f"01/17/2024 14:02:16 [INFO|DP=0|PP=0|TP=0]: iteration: {it} / {c} | "
                         f"elapsed_time_per_iteration_ms: {a} | global_batch_size: {c} | lm_loss: {a} | lr: {b} | "
                         f"grad_norm: {b}"),
    lambda it, a, b, c: f"[rank{c}]:[titan] - root - INFO - step: {it}  loss: {a}  grad_norm: {b}  tps: {c}",
    lambda it, a, b, c: f"{{'loss': {a}, 'grad_norm': {b}, 'learning_rate': {c}, 'epoch': {a}}}",
    lambda it, a, b, c: f"Epoch {c}:  50%|█    | {it}/{c} [00:01<00:01, {b}it/s, loss={a}, v_num=0]",
    lambda it, a, b, c: f"Epoch {it}: {c}/? [00:01<00:01, {b}s/it, train_loss={a}]\r",
    lambda it, a, b, c: f"step={it} loss={a} grad_norm={b} lr={c} step_time={b}ms batch_size={c}",
    lambda it, a, b, c: (f"RuntimeError: Rank {c}, node n{c}, device {c}, iteration {it}: Unexpected result {a} "
                         f"(message='found NaN in local grad norm for bucket #{c}')"),
    lambda it, a, b, c: f"Rank {c}, node n{c}, device {c}, iteration #{it}: Possible persistent error!!",
    lambda it, a, b, c: f"  successfully loaded checkpoint from /ckpt [ t 1/1, p 1/1 ] at iteration {it}",
    lambda it, a, b, c: f"Training starts at step {it}",
    lambda it, a, b, c: "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2, reducing to 1",
]

framework_line = st.builds(lambda t, it, a, b, c: TEMPLATES[t](it, a, b, c), st.integers(0, len(TEMPLATES) - 1),
                           steps, values, values, st.integers(0, 10 ** 6))
any_line = st.one_of(st.text(max_size=300), framework_line)
logs = st.lists(any_line, max_size=40)
thresholds = st.builds(Thresholds, spike_ratio=st.floats(0.01, 100), grad_spike_k=st.floats(0.01, 100),
                       throughput_drop=st.floats(0.01, 0.99), window=st.integers(1, 50),
                       grad_window=st.integers(1, 60), grad_min_history=st.integers(0, 20),
                       throughput_min_history=st.integers(0, 10), throughput_min_records=st.integers(1, 10),
                       grad_norm_max=st.one_of(st.none(), st.floats(0.001, 1e9)))


@settings(max_examples=examples(400), deadline=None)
@given(any_line)
def test_any_line_parses_without_raising(line):
    rec = parse_line(line)
    parse_event(line)
    if rec is not None and rec.iteration is not None:
        assert 0 <= rec.iteration < 10 ** 16


@settings(max_examples=examples(300), deadline=None)
@given(logs, thresholds)
def test_any_log_analyses_without_raising_and_gives_valid_json(lines, th):
    log = scan_log(lines)
    a = analyze(log.records, th, log.events, log.duplicates)
    format_summary("x.log", a)
    json.dumps(a.to_dict(), allow_nan=False)  # NaN/inf spelled as strings
    assert a.records == len(log.records) and all(f.severity in ("critical", "warning") for f in a.flags)
    for f in a.flags:
        assert f.value is None or isinstance(f.value, float)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs)
def test_the_command_never_raises(lines):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "train.log")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write("\n".join(lines))
        from argparse import Namespace

        code = main_from_args(Namespace(file=path, json=True, plot=None, grad_norm_max=None, spike_ratio=None,
                                        grad_spike_k=None, throughput_drop=None, time_spike_ratio=None))
        assert code in (0, 1, 2)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs)
@example([TEMPLATES[0](0, 0.0, 5.179474500004146e+245, 0), TEMPLATES[0](0, 0.0, 1.0, 0)])  # lr 5e245: overflowed
def test_the_plot_never_raises(lines):
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # optional extra
        return
    from gpuguard.trainlog.plot import figure

    log = scan_log(lines)
    fig = figure(log.records, analyze(log.records, events=log.events))
    plt.close(fig)


def test_megatron_numbers_round_trip():
    for loss in (1e-30, 2.5, 1e30, float("nan"), float("inf")):
        rec = parse_line(TEMPLATES[0](42, loss, 0.5, 16))
        assert rec.iteration == 42 and rec.batch_size == 16
        assert (math.isnan(rec.loss) and math.isnan(loss)) or rec.loss == float(f"{loss:.6E}")
