"""`gpuguard trainlog`: exit codes, JSON, one-line errors, short logs, and the 4-panel plot."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from clirun import gpuguard

from gpuguard.trainlog import analyze, main_from_args, scan_log

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "trainlog"


def run_cli(*args, stdin=None):
    return gpuguard("trainlog", *args, input=stdin)


def args(path, **kw):
    base = dict(file=str(path), json=False, plot=None, grad_norm_max=None, spike_ratio=None, grad_spike_k=None,
                throughput_drop=None, time_spike_ratio=None)
    base.update(kw)
    return Namespace(**base)


def test_summary_json_and_exit_codes(tmp_path):
    p = run_cli(str(FIX / "synthetic_gpt_run.log"))
    assert p.returncode == 1
    assert "CRITICAL loss_missing" in p.stdout and "iteration 1200" in p.stdout
    assert "resumed at iteration 2810" in p.stdout
    j = run_cli(str(FIX / "megatron_deepspeed_issue396_nan.log"), "--json")
    data = json.loads(j.stdout)  # valid JSON although grad norms are NaN
    assert j.returncode == 1 and data["records"] == 3
    assert {f["kind"] for f in data["flags"]} == {"loss_missing", "grad_norm_nonfinite"}
    clean = tmp_path / "clean.log"
    clean.write_text("\n".join(f"step={i} loss={5 - i * 0.01:.3f} lr=1e-4 step_time=0.5" for i in range(1, 50)))
    assert run_cli(str(clean)).returncode == 0
    assert run_cli("-", stdin=(FIX / "torchtitan_pr3393.log").read_text()).returncode == 0
    raw = subprocess.run([sys.executable, "-m", "gpuguard", "trainlog", "-"], capture_output=True, timeout=60,
                         input=b"\xff\xfe step=1 loss=2.0\r\nstep=2 loss=1.9 \x80\r\n")  # not UTF-8, CRLF
    assert raw.returncode == 0 and b"2 logged iterations" in raw.stdout


def test_missing_or_unreadable_input_is_one_line_and_exit_2(tmp_path):
    for path in (tmp_path / "nope.log", tmp_path):
        p = run_cli(str(path))
        assert p.returncode == 2 and p.stdout == ""
        assert p.stderr.startswith("gpuguard trainlog: cannot read ") and p.stderr.count("\n") == 1, p.stderr


@pytest.mark.parametrize("content,code", [
    ("", 2),                                                          # 0 lines
    ("using world size: 8\n", 2),                                      # a header only
    (" iteration        1/     100 | lm loss: 1.0E+01 |\n", 0),         # 1 line
    (" iteration        1/     100 | lm loss: 1.0E+01 |\n iteration        2/     100 |\n", 1),  # 2, loss gone
    ("{'loss': 2.0, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.01}", 1),
])
def test_short_logs_never_crash(tmp_path, content, code):
    f = tmp_path / "short.log"
    f.write_text(content)
    out = tmp_path / "short.png"
    assert main_from_args(args(f)) == code
    pytest.importorskip("matplotlib")
    assert main_from_args(args(f, plot=str(out), json=True)) == code
    assert (code == 2) != out.exists()


def test_framework_messages_alone_are_reported(capsys):
    assert main_from_args(args(FIX / "nemo_issue14348_rerun_nan.log")) == 1
    out = capsys.readouterr().out
    assert "no training progress lines" in out and "CRITICAL nan_check" in out


def test_bad_options_are_a_clear_error(capsys):
    f = FIX / "kv_run.log"
    assert main_from_args(args(f, spike_ratio=-1)) == 2
    assert main_from_args(args(f, throughput_drop=1.5)) == 2
    assert main_from_args(args(f, grad_spike_k=0)) == 2
    assert main_from_args(args(f, time_spike_ratio=0.5)) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == "gpuguard trainlog: --throughput-drop must be between 0 and 1, got 1.5"
    assert main_from_args(args(f, time_spike_ratio=2.0)) == 1  # the old option still works (drop = 50%)
    assert run_cli(str(f), "--grad-spike-k", "3", "--throughput-drop", "0.3").returncode == 1


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (optional extra gpuguard[plot])")
    out = tmp_path / "run.png"
    p = run_cli(str(FIX / "synthetic_gpt_run.log"), "--plot", str(out))
    assert p.returncode == 1 and "plot written" in p.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 30_000
    bad = run_cli(str(FIX / "kv_run.log"), "--plot", str(tmp_path / "no" / "dir" / "x.png"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cannot write the plot" in bad.stderr


def test_plot_has_four_panels_on_one_axis_with_restarts_and_skips_marked():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from gpuguard.trainlog.plot import figure

    log = scan_log((FIX / "synthetic_gpt_run.log").read_text().splitlines())
    a = analyze(log.records, events=log.events)
    fig = figure(log.records, a)
    try:
        axes = fig.axes
        assert [ax.get_ylabel() for ax in axes] == ["loss (lm loss)", "learning rate", "grad norm (log)",
                                                     "time (s/sample)"]
        assert all(ax.get_shared_x_axes().joined(axes[0], ax) for ax in axes)
        assert axes[2].get_yscale() == "log" and axes[0].get_yscale() == "linear"
        for ax in axes:  # the resumed attempt: a dashed line at 2810 on every panel
            assert any(line.get_linestyle() == "--" and list(line.get_xdata()) == [2810, 2810]
                       for line in ax.get_lines())
        crosses = [line for line in axes[0].get_lines() if line.get_marker() == "x"]
        assert [list(line.get_xdata()) for line in crosses] == [[1200]]  # the interval without a loss
        labels = [t.get_text() for t in axes[0].texts]
        assert "loss_missing" in labels and "loss_spike" in labels and "resumed at 2810" in labels
        assert "throughput_drop" in [t.get_text() for t in axes[3].texts]
    finally:
        plt.close(fig)

    fp16 = scan_log((FIX / "synthetic_fp16_skips.log").read_text().splitlines())
    fig = figure(fp16.records, analyze(fp16.records))
    try:
        crosses = [line for line in fig.axes[0].get_lines() if line.get_marker() == "x"]
        assert list(crosses[0].get_xdata()) == [10, 20, 30, 150, 260, 270, 280]  # every skipped interval
    finally:
        plt.close(fig)
