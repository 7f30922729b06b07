"""Context from Slurm's environment: hostile values are dropped, never interpreted."""

import pytest

from gpuguard.context import context_from_env, parse_gpu_list


def test_prolog_env_gives_job_gpus():
    ctx = context_from_env("prolog", {"SLURMD_NODENAME": "p5-st-1", "SLURM_JOB_ID": "4242",
                                      "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_JOB_USER": "alice",
                                      "SLURM_JOB_RESTART_COUNT": "2"})
    assert ctx.node == "p5-st-1" and ctx.job_id == "4242" and ctx.gpu_indices == (0, 1, 2, 3)
    assert ctx.job_user == "alice" and ctx.restart_count == 2 and not ctx.ignored_env


def test_cuda_visible_devices_fallback_and_ranges():
    assert context_from_env("prolog", {"SLURM_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": "0-3,6"}).gpu_indices == (0, 1, 2, 3, 6)


def test_job_without_gpus_checks_no_gpu():
    assert context_from_env("prolog", {"SLURM_JOB_ID": "7"}).gpu_indices == ()


def test_healthcheck_checks_all_gpus():
    assert context_from_env("healthcheck", {"SLURM_JOB_GPUS": "0"}).gpu_indices is None


@pytest.mark.parametrize("var,value", [
    ("SLURM_JOB_GPUS", "0;rm -rf /"), ("SLURMD_NODENAME", "node1 $(id)"), ("SLURM_JOB_ID", "12 && reboot"),
    ("SLURM_JOB_USER", "bob\nroot"), ("SLURM_JOB_RESTART_COUNT", "9999999999"),
])
def test_hostile_values_are_ignored(var, value):
    env = {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "5", var: value}
    ctx = context_from_env("prolog", env)
    assert var in ctx.ignored_env
    assert value not in (ctx.node, ctx.job_id, ctx.job_user)


def test_exit_code_signal_is_128_plus():
    assert context_from_env("epilog", {"SLURM_JOB_EXIT_CODE2": "0:9"}).job_exit_code == 137
    assert context_from_env("epilog", {"SLURM_JOB_EXIT_CODE2": "3:0"}).job_exit_code == 3


def test_parse_gpu_list_rejects_uuids():
    with pytest.raises(ValueError):
        parse_gpu_list("GPU-5d1c3b7a-1111-2222-3333-444455556666")
    assert parse_gpu_list("") == ()
