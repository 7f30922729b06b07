"""`gpuguard render` / `gpuguard templates` as a user runs them (the real CLI: tests/clirun.py)."""

from __future__ import annotations

import pytest
from clirun import gpuguard

from gpuguard.config.schema import ConfigError
from gpuguard.siteconfig import parse_config
from gpuguard.templates.cli import merge_values, parse_set


def gg(*args, config=None, cwd=None):
    env_args = ["--config", str(config)] if config else []
    return gpuguard(*args[:1], *env_args, *args[1:], cwd=cwd)


def test_parse_set():
    assert parse_set(["nodes=4", "monitor=true", "command=[a.py, --x, '1']", "env.FOO=bar baz", "job_name="]) == {
        "nodes": 4, "monitor": True, "command": ["a.py", "--x", "1"], "env": {"FOO": "bar baz"}, "job_name": ""}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_set(["nodes"])
    # issue 29: a bad name is named, not called a missing '='
    with pytest.raises(ValueError, match="'BAD-NAME' is not a valid name"):
        parse_set(["env.BAD-NAME=1"])
    assert merge_values({"env": {"A": 1}, "nodes": 2}, {"env": {"B": 2}}, {"nodes": 3}) == \
        {"env": {"A": 1, "B": 2}, "nodes": 3}


def test_render_from_job_yaml_with_site_defaults(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("templates:\n  defaults:\n    max_requeues: 5\n    gpuguard: /opt/gg/bin/gpuguard\n"
                   "    nccl-tests.sbatch.j2: {iters: 7}\n")
    job = tmp_path / "job.yaml"
    job.write_text("nodes: 2\npreset: p5.48xlarge\ncommand: [train.py, --lr, '3e-4']\nenv: {WANDB_PROJECT: demo}\n")
    out = tmp_path / "job.sbatch"
    p = gg("render", "torchrun.sbatch.j2", "-c", str(job), "--set", "nodes=4", "-o", str(out), config=cfg)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert "#SBATCH --nodes=4" in text and "MAX_FAILURES=5" in text and "GPUGUARD=/opt/gg/bin/gpuguard" in text
    assert "export WANDB_PROJECT=demo" in text and "train.py --lr 3e-4" in text
    assert out.stat().st_mode & 0o111
    p = gg("render", "nccl-tests.sbatch.j2", "--set", "nodes=2", config=cfg)
    assert p.returncode == 0 and "-n 7 " in p.stdout


def test_render_errors_name_the_variable(tmp_path):
    p = gg("render", "torchrun.sbatch.j2", "--set", "nodes=2")
    assert p.returncode == 2 and "missing required variable 'command'" in p.stderr
    p = gg("render", "torchrun.sbatch.j2", "--set", "nodes=2", "--set", "command=[t.py]", "--set", "gpu_per_node=4")
    assert p.returncode == 2 and "unknown variable 'gpu_per_node' (did you mean 'gpus_per_node'?)" in p.stderr
    bad = tmp_path / "c.yaml"
    bad.write_text("templates:\n  defaults: {max_requeue: 3}\n")
    p = gg("render", "torchrun.sbatch.j2", "--set", "nodes=2", "--set", "command=[t.py]", config=bad)
    assert p.returncode == 2 and "templates.defaults.max_requeue: no template declares this variable" in p.stderr


def test_a_job_file_that_is_not_yaml_is_named_with_its_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("nodes: 2\ncommand: [train.py\npreset: p5.48xlarge\n")
    p = gg("render", "torchrun.sbatch.j2", "-c", str(job))
    assert p.returncode == 2 and f"not valid YAML: {job}: line 3" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_render_warns_about_bad_settings_it_was_given():
    p = gg("render", "torchrun.sbatch.j2", "--set", "nodes=2", "--set", "command=[t.py]", "--set",
           "env.NCCL_DEBUG=INFO")
    assert p.returncode == 0 and "[nccl-debug-info]" in p.stderr and "export NCCL_DEBUG=INFO" in p.stdout


def test_templates_list_show_presets():
    p = gg("templates", "list")
    assert p.returncode == 0 and "torchrun.sbatch.j2" in p.stdout and "nccl-tests.sbatch.j2" in p.stdout
    p = gg("templates", "show", "nccl-tests.sbatch.j2")
    assert "min_bytes" in p.stdout and "(required)" in p.stdout
    p = gg("templates", "presets", "p5.48xlarge")
    assert "FI_EFA_USE_HUGE_PAGE=0" in p.stdout and "unset NCCL_PROTO" in p.stdout
    p = gg("templates", "presets")
    assert "dgx-h100-ib" in p.stdout


def test_config_section_is_validated():
    cfg = parse_config("templates:\n  store_path: /var/lib/gpuguard/attempts-{node}.db\n  defaults: {nodes: 2}\n")
    assert cfg.templates.store_path.endswith("{node}.db")
    with pytest.raises(ConfigError, match=r"line 2: templates.defaults: expected a mapping"):
        parse_config("templates:\n  defaults: [nodes]\n")


def test_the_batch_scripts_bookkeeping_imports_no_renderer():
    """`gpuguard job-attempt` runs at the start and end of every attempt of every job: it parses and dispatches
    without Jinja, the renderer or the linter (those are `gpuguard render` / `lint`)."""
    import subprocess
    import sys

    code = ("import sys; from gpuguard.cli.main import build_parser, FEATURE_COMMANDS; "
            "build_parser(FEATURE_COMMANDS['job-attempt']).parse_args(['job-attempt', 'begin', '--job-dir', 'd', "
            "'--attempt', '1']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jinja2' "
            "or m in ('gpuguard.templates.render', 'gpuguard.templates.lint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
