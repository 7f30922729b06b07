"""Rendering sbatch templates: variables are declared and checked, every value is shell-quoted, the output is
valid bash (bash -n, shellcheck) and matches the golden file of each preset."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuguard.templates import TemplateError, list_templates, render_template, template_variables
from gpuguard.templates.render import Renderer

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "golden"
REGEN = os.environ.get("GPUGUARD_REGEN_GOLDEN") == "1"

TRAIN = {"nodes": 2, "command": ["train.py", "--config", "conf/llama.yaml"], "time_limit": "2-00:00:00",
         "partition": "gpu", "checkpoint_dir": "/fsx/ckpt/llama", "checkpoint_glob": "step-*",
         "gpuguard": "/usr/local/bin/gpuguard"}
NCCL = {"nodes": 2, "binary": "/opt/nccl-tests/build/all_reduce_perf", "partition": "gpu"}

# (golden file, template, values): one per preset and stack, plus the nccl-tests job
CASES = [
    ("torchrun-p5.48xlarge-efa.sbatch", "torchrun.sbatch.j2", {**TRAIN, "preset": "p5.48xlarge"}),
    ("torchrun-p5en.48xlarge-efa.sbatch", "torchrun.sbatch.j2", {**TRAIN, "preset": "p5en.48xlarge"}),
    ("torchrun-p6-b200.48xlarge-efa.sbatch", "torchrun.sbatch.j2", {**TRAIN, "preset": "p6-b200.48xlarge"}),
    ("torchrun-p4d.24xlarge-efa.sbatch", "torchrun.sbatch.j2", {**TRAIN, "preset": "p4d.24xlarge"}),
    ("torchrun-p4de.24xlarge-efa-ofi-1.6.sbatch", "torchrun.sbatch.j2",
     {**TRAIN, "preset": "p4de.24xlarge", "stack": {"libfabric": "1.17.1", "aws_ofi_nccl": "1.7.1"}}),
    ("torchrun-p4d.24xlarge-efa-ofi-1.5.sbatch", "torchrun.sbatch.j2",
     {**TRAIN, "preset": "p4d.24xlarge", "stack": "efa-ofi-1.5"}),
    ("torchrun-dgx-h100-ib.sbatch", "torchrun.sbatch.j2",
     {**TRAIN, "preset": "dgx-h100-ib", "monitor": True, "monitor_interval_s": 10, "checkpoint_kind": "megatron",
      "resume_arg": "--load", "no_retry_exit_codes": [2, 3], "max_requeues": 5}),
    ("torchrun-generic.sbatch", "torchrun.sbatch.j2",
     {"nodes": 1, "gpus_per_node": 0, "nproc_per_node": 2, "command": "train.py --epochs 3", "exclusive": False,
      "resume_arg": "", "checkpoint_dir": "ckpt", "checkpoint_kind": "latest", "rdzv_port": 29400}),
    ("nccl-tests-p5.48xlarge.sbatch", "nccl-tests.sbatch.j2", {**NCCL, "preset": "p5.48xlarge"}),
    ("nccl-tests-dgx-h100-ib.sbatch", "nccl-tests.sbatch.j2",
     {**NCCL, "preset": "dgx-h100-ib", "binary": "all_gather_perf", "nodelist": "dgx[01-02]", "min_bytes": "1M",
      "max_bytes": "16G", "iters": 50, "output": "/shared/nccl/%j.out", "time_limit": "00:20:00",
      "extra_args": ["-d", "bfloat16"]}),
]


def _render(template: str, values: dict) -> str:
    return render_template(template, values)


def test_templates_are_listed_without_shared_parts():
    assert list_templates() == ["nccl-tests.sbatch.j2", "torchrun.sbatch.j2"]


def test_nccl_tests_contract_variables_are_declared_and_documented():
    # issue 5 renders nccl-tests through this API: these variables are its contract
    specs = template_variables("nccl-tests.sbatch.j2")
    for name in ("nodes", "nodelist", "partition", "gpus_per_node", "binary", "min_bytes", "max_bytes", "iters",
                 "preset", "output", "time_limit"):
        assert name in specs and specs[name].help
    assert specs["nodes"].required and not specs["nodelist"].required and not specs["partition"].required


@pytest.mark.parametrize("golden,template,values", CASES, ids=[c[0] for c in CASES])
def test_golden(golden, template, values):
    text = _render(template, values)
    path = GOLDEN / golden
    if REGEN or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{golden} changed: re-render with GPUGUARD_REGEN_GOLDEN=1 and review the diff"


@pytest.mark.parametrize("golden,template,values", CASES, ids=[c[0] for c in CASES])
def test_rendered_script_is_valid_bash(golden, template, values, tmp_path):
    script = tmp_path / golden
    script.write_text(_render(template, values))
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("golden,template,values", CASES, ids=[c[0] for c in CASES])
def test_rendered_script_passes_shellcheck(golden, template, values, tmp_path):
    script = tmp_path / golden
    script.write_text(_render(template, values))
    p = subprocess.run(["shellcheck", "-s", "bash", "-S", "info", str(script)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout


def test_preset_environment_is_in_the_script():
    p5 = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "p5.48xlarge", "fabric_check": False})
    assert "export FI_EFA_USE_HUGE_PAGE=0" in p5 and "export NCCL_DEBUG=WARN" in p5
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in p5
    # the flight recorder under PyTorch's current names (pytorch/pytorch#152563), not the deprecated ones
    # the old flight-recorder names are only set on nodes whose torchrun is older (gpuguard_stop_mode)
    assert "export TORCH_FR_BUFFER_SIZE=2000" in p5 and "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000" not in p5
    assert 'export TORCH_FR_DUMP_TEMP_FILE="${JOB_DIR}"/flight-recorder/nccl_trace_rank_' in p5
    # node-local caches live in the private directory each node creates (inside gpuguard_node)
    node_fn = p5[p5.index("gpuguard_node() {"):p5.index("gpuguard_filter() {")]
    assert 'export TRITON_CACHE_DIR="${LOCAL_DIR}"/triton-cache' in node_fn and 'mkdir -m 700' in node_fn
    # modern stack: no protocol/algorithm pinning (it disables the aws-ofi-nccl tuner), not even inherited
    assert "export NCCL_PROTO" not in p5 and "unset NCCL_PROTO" in p5 and "unset NCCL_ALGO" in p5
    # never NCCL_SOCKET_IFNAME on P5 (AWS: leave it to NCCL), not even the node's own interface (issue 29)
    ifname_fn = p5[p5.index("gpuguard_socket_ifname() {"):p5.index("gpuguard_route_dev() {")]
    assert "export GPUGUARD_NCCL_IFNAME=0" in p5
    assert "NCCL_SOCKET_IFNAME=" not in p5.split("# Preset:")[1].split("\n", 1)[1].replace(ifname_fn, "")
    assert "FI_EFA_USE_DEVICE_RDMA" not in p5 and "FI_PROVIDER" not in p5
    legacy = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "p4d.24xlarge", "stack": "efa-ofi-1.5"})
    for line in ("export FI_EFA_USE_DEVICE_RDMA=1", "export FI_PROVIDER=efa", "export NCCL_PROTO=simple"):
        assert line in legacy
    ib = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "dgx-h100-ib"})
    assert "export NCCL_IB_HCA='=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11'" in ib
    assert "export NCCL_NET_GDR_LEVEL=PXB" in ib


def test_fabric_check_logs_init_and_net_into_per_rank_files():
    p5 = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "p5.48xlarge"})
    for line in ("export NCCL_DEBUG=INFO", "export NCCL_DEBUG_SUBSYS=INIT,NET",
                 'export NCCL_DEBUG_FILE="${ATTEMPT_DIR}"/nccl/%h.%p.log',
                 '"$GPUGUARD" job-attempt fabric --job-dir "$JOB_DIR" --attempt "$ATTEMPT" --expect efa'):
        assert line in p5, line
    assert "--expect ib" in _render("torchrun.sbatch.j2", {**TRAIN, "preset": "dgx-h100-ib"})
    generic = _render("torchrun.sbatch.j2", TRAIN)  # no fabric to check: NCCL stays at WARN on the console
    assert "job-attempt fabric" not in generic and "NCCL_DEBUG_FILE" not in generic
    assert "export NCCL_DEBUG=WARN" in generic


def test_version_warnings_and_workarounds_from_the_stack():
    text = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "p4d.24xlarge", "stack": {
        "aws_ofi_nccl": "1.14.0", "efa_installer": "1.28.0", "nccl": "2.21.5"}})
    assert "# WARNING: aws-ofi-nccl 1.14.0 is reported to deadlock" in text
    assert "export FI_EFA_SET_CUDA_SYNC_MEMOPS=0" in text
    p6 = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "p6-b200.48xlarge", "stack": {"aws_ofi_nccl": "1.15.0"}})
    assert "# WARNING: aws-ofi-nccl 1.15.0 on p6-b200.48xlarge" in p6 and "use 1.16.0 or later" in p6
    ok = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "p5en.48xlarge", "stack": {"aws_ofi_nccl": "1.16.3",
                                                                                      "nccl": "2.27.7"}})
    assert "# WARNING" not in ok and "FI_EFA_SET_CUDA_SYNC_MEMOPS" not in ok


def test_every_exported_variable_has_a_why_comment():
    text = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "dgx-h100-ib", "nvls_enable": False})
    lines = text.splitlines()
    start = lines.index(next(x for x in lines if x.startswith("# ---- environment")))
    block = lines[start:lines.index("", start)]
    exports = [i for i, line in enumerate(block) if line.startswith("export ")]
    assert len(exports) >= 8 and any("NCCL_NVLS_ENABLE=0" in block[i] for i in exports)
    for i in exports:
        assert block[i - 1].startswith("# "), f"no why-comment above {block[i]!r}"


def test_job_env_overrides_the_preset():
    text = _render("torchrun.sbatch.j2", {**TRAIN, "preset": "p5.48xlarge", "env": {"NCCL_DEBUG": "INFO",
                                                                                    "MY_VAR": "a b"}})
    assert "export NCCL_DEBUG=INFO" in text and "export NCCL_DEBUG=WARN" not in text
    assert "export MY_VAR='a b'" in text


def test_requeue_machinery_is_rendered():
    text = _render("torchrun.sbatch.j2", {**TRAIN, "requeue_grace_s": 600, "max_requeues": 4,
                                          "no_retry_exit_codes": [3]})
    for needle in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR1@600",
                   "trap gpuguard_on_usr1 USR1", "MAX_FAILURES=4", "MAX_CONTINUATIONS=50",
                   "--no-retry-exit-code 3", 'scancel --signal=TERM "$SLURM_JOB_ID"', '--rdzv-id="$SLURM_JOB_ID"',
                   "--rdzv-backend=c10d", '--nnodes="$NNODES"', "NPROC=8", "--max-restarts=0",
                   "TRAIN+=(--resume \"$GPUGUARD_RESUME_FROM\")", "NNODES=${SLURM_JOB_NUM_NODES:-2}",
                   'srun --nodes="$NNODES"', "--max-failures", "--max-continuations"):
        assert needle in text, needle
    # max_failures wins over the deprecated max_requeues
    assert "MAX_FAILURES=1" in _render("torchrun.sbatch.j2", {**TRAIN, "max_requeues": 4, "max_failures": 1})


@pytest.mark.parametrize("grace,explicit,expect", [(300, None, 270), (200, None, 180), (100, None, 90),
                                                   (59, None, 54), (3, None, 1), (300, 120, 120)])
def test_torchrun_shutdown_window_comes_from_the_grace(grace, explicit, expect):
    """torchrun SIGKILLs its workers 30 s after forwarding SIGTERM unless told otherwise (issue 10)."""
    from gpuguard.templates.render import shutdown_timeout

    assert shutdown_timeout(grace, explicit) == expect
    values = {**TRAIN, "requeue_grace_s": grace}
    if explicit:
        values["shutdown_timeout_s"] = explicit
    assert f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={expect}\n" in _render("torchrun.sbatch.j2", values)


def test_containers_and_srun_extra():
    text = _render("torchrun.sbatch.j2", {**TRAIN, "container_image": "nvcr.io#nvidia/pytorch:25.01-py3",
                                          "container_mounts": ["/fsx:/fsx", "/data:/data:ro"],
                                          "container_workdir": "/workspace", "srun_extra": ["--cpu-bind=none"]})
    assert ("SRUN=(srun --nodes=\"$NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 \"${SRUN_EXCLUDE[@]}\" --label "
            "--container-image='nvcr.io#nvidia/pytorch:25.01-py3' --container-mounts=\"$CONTAINER_MOUNTS\" "
            "--container-workdir=/workspace --cpu-bind=none)") in text
    assert 'CONTAINER_MOUNTS="${JOB_DIR}:${JOB_DIR},${GPUGUARD_LOCAL_ROOT}:${GPUGUARD_LOCAL_ROOT}"' in text
    assert "CONTAINER_MOUNTS+=,/fsx:/fsx,/data:/data:ro" in text
    assert "--shutdown-timeout" not in text.split("gpuguard_begin\n", 1)[1]  # torchrun is inside the image
    with pytest.raises(TemplateError, match="cannot contain one"):
        _render("torchrun.sbatch.j2", {**TRAIN, "container_image": "x", "container_mounts": ["/a:/a,/b:/b"]})


def test_labelled_output_and_the_planned_stop_line():
    text = _render("torchrun.sbatch.j2", TRAIN)
    assert "export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]: '" in text and " --tee=3" in text
    assert "torchrun stopped its workers for a planned checkpoint-and-requeue" in text
    plain = _render("torchrun.sbatch.j2", {**TRAIN, "label_output": False})
    assert "--tee=3" not in plain and "--label" not in plain


def test_monitor_sidecar_only_when_asked():
    off = _render("torchrun.sbatch.j2", TRAIN)
    assert "monitor --job-dir" not in off
    on = _render("torchrun.sbatch.j2", {**TRAIN, "monitor": True, "gpuguard_config": "/etc/gpuguard/c.yaml"})
    assert ('srun --overlap --nodes="$NNODES" --ntasks-per-node=1 "$GPUGUARD" monitor --job-dir "$JOB_DIR" '
            "--config /etc/gpuguard/c.yaml &") in on
    # started before the training step and never killed by the script: srun would SIGKILL it; Slurm's SIGTERM at
    # the end of the job lets it send its resolved alerts and remove its metrics file
    assert on.index("monitor --job-dir") < on.index('"${TRAIN[@]}" &') and "MONITOR_PID" not in on


# --------------------------------------------------------------------------- errors name the variable


@pytest.mark.parametrize("values,needle", [
    ({"command": ["t.py"]}, "missing required variable 'nodes'"),
    ({"nodes": 2}, "missing required variable 'command'"),
    ({"nodes": 2, "command": ["t.py"], "nodez": 3}, "unknown variable 'nodez' (did you mean 'nodes'?)"),
    ({"nodes": "two", "command": ["t.py"]}, "variable 'nodes': expected an integer"),
    ({"nodes": 0, "command": ["t.py"]}, "variable 'nodes': expected an integer >= 1"),
    ({"nodes": 2, "command": ["t.py"], "exclusive": "yes"}, "variable 'exclusive': expected true or false"),
    ({"nodes": 2, "command": ["t.py"], "time_limit": "soon"}, "variable 'time_limit': not a Slurm time limit"),
    ({"nodes": 2, "command": ["t.py"], "preset": "p5.48xlarg"}, "unknown instance type 'p5.48xlarg' (did you mean"),
    ({"nodes": 2, "command": ["t.py"], "preset": "p5.48xlarge", "stack": "efa-ofi-1.5"},
     "'efa-ofi-1.5' is not supported on p5.48xlarge"),
    ({"nodes": 2, "command": ["t.py"], "preset": "p5.48xlarge", "stack": {"aws_ofi_nccl": "1.7.1"}},
     "p5.48xlarge needs aws-ofi-nccl >= 1.7.2"),
    ({"nodes": 2, "command": ["t.py"], "job_name": "a\nb"}, "control characters"),
    ({"nodes": 2, "command": ["t.py"], "partition": "gpu\n#SBATCH --qos=high"}, "control characters"),
    ({"nodes": 2, "command": ["t.py"], "env": {"BAD-NAME": "x"}}, "'BAD-NAME' is not a shell variable name"),
    ({"nodes": 2, "command": ["t.py"], "no_retry_patterns": ["("]}, "bad regular expression"),
    ({"nodes": 2, "command": ["t.py"], "checkpoint_kind": "newest"}, "expected one of glob, megatron, latest"),
])
def test_clear_errors(values, needle):
    with pytest.raises(TemplateError) as e:
        _render("torchrun.sbatch.j2", values)
    assert needle in str(e.value) and "torchrun.sbatch.j2" in str(e.value)


def test_unknown_template_is_named():
    with pytest.raises(TemplateError, match=r"no template 'torchrun.j2' \(did you mean 'torchrun.sbatch.j2'\?\)"):
        _render("torchrun.j2", {})


def test_nccl_tests_without_mpi_needs_one_node():
    with pytest.raises(TemplateError, match="mpi: none runs independent single-node tests"):
        _render("nccl-tests.sbatch.j2", {**NCCL, "mpi": "none"})
    one = _render("nccl-tests.sbatch.j2", {**NCCL, "nodes": 1, "mpi": "none", "gpus_per_node": 4})
    assert "all_reduce_perf -b 8 -e 8G -f 2 -g 4 -n 20 -w 5 -c 1\n" in one


def test_a_template_cannot_escape_the_quoting(tmp_path):
    (tmp_path / "evil.sbatch.j2").write_text(
        "{#- gpuguard:variables\nx: {type: str, required: true, help: x}\n-#}\necho {{ x|safe }}\n")
    r = Renderer(dirs=[tmp_path])
    with pytest.raises(TemplateError, match="safe"):
        r.render("evil.sbatch.j2", {"x": "$(id)"})
    (tmp_path / "undeclared.sbatch.j2").write_text("echo {{ y }}\n")
    with pytest.raises(TemplateError, match="'y' is undefined"):
        Renderer(dirs=[tmp_path]).render("undeclared.sbatch.j2", {})


def test_a_broken_variables_header_names_the_template_and_line(tmp_path):
    (tmp_path / "broken.sbatch.j2").write_text(
        "{#- gpuguard:variables\nnodes: {type: int, help: n}\n  bad: [1\n-#}\n#!/bin/bash\n")
    with pytest.raises(TemplateError, match=r"^broken.sbatch.j2 \(gpuguard:variables header\): line \d"):
        Renderer(dirs=[tmp_path]).render("broken.sbatch.j2", {})


def test_site_template_directory_wins(tmp_path):
    (tmp_path / "torchrun.sbatch.j2").write_text(
        "{#- gpuguard:variables\nnodes: {type: int, required: true, help: n}\n-#}\n#!/bin/bash\n# site {{ nodes }}\n")
    assert render_template("torchrun.sbatch.j2", {"nodes": 3}, template_dirs=[str(tmp_path)]) == \
        "#!/bin/bash\n# site 3\n"


def test_a_job_name_with_a_slash_is_refused_when_the_output_file_is_named_after_it():
    """Issue 29: job_name 'a/b' with output '%x-%j.out' made Slurm fail the job with no output file at all."""
    with pytest.raises(TemplateError, match="'job_name'.*contains '/'"):
        _render("torchrun.sbatch.j2", {**TRAIN, "job_name": "exp/1"})
    assert "#SBATCH --job-name=exp/1" in _render("torchrun.sbatch.j2",
                                                  {**TRAIN, "job_name": "exp/1", "output": "logs/%j.out"})


def test_no_checkpoint_dir_is_warned_about():
    """Issue 29: without checkpoint_dir every time-limit requeue restarted from step 0, silently."""
    warning = "# WARNING: checkpoint_dir is not set"
    assert warning in _render("torchrun.sbatch.j2", {k: v for k, v in TRAIN.items() if k != "checkpoint_dir"})
    assert warning not in _render("torchrun.sbatch.j2", TRAIN)


def _preflight_block(values: dict) -> str:
    text = _render("torchrun.sbatch.j2", values)
    start = text.find("# ---- pre-flight")
    return text[start:text.index("# ---- training")] if start >= 0 else ""


@pytest.mark.parametrize("nnodes,rc,expect", [
    (2, 10, "END 10 preflight --blamed node[2-3]"),
    (2, 0, "TRAINING"),
    (2, 2, "the pre-flight itself failed (exit 2): starting the training without it\nTRAINING"),
    (1, 10, "TRAINING"),  # one node: nothing between nodes to test
])
def test_the_preflight_runs_before_training_and_a_blame_ends_the_attempt(tmp_path, nnodes, rc, expect):
    block = _preflight_block({**TRAIN, "preflight": True, "preflight_budget_s": 30})
    assert '"$GPUGUARD" preflight --exclude-file "${ATTEMPT_DIR}/preflight-exclude" --budget 30' in block
    fake = tmp_path / "gpuguard"
    fake.write_text(f'#!/bin/bash\necho "ran: $*"\n[ {rc} = 10 ] && echo "node[2-3]" >"$3"\nexit {rc}\n')
    fake.chmod(0o755)
    script = (f"GPUGUARD={fake}\nATTEMPT_DIR={tmp_path}\nNNODES={nnodes}\nEVENT=none\nEND_ARGS=(--max-failures 3)\n"
              'gpuguard_end() { echo "END $1 $EVENT ${END_ARGS[*]:2}"; exit 0; }\n' + block + "echo TRAINING\n")
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    lines = [ln.removeprefix("gpuguard: ") for ln in (p.stderr + p.stdout).splitlines()]
    ran = [ln for ln in lines if ln.startswith("ran: ")]
    assert ran == ([f"ran: preflight --exclude-file {tmp_path}/preflight-exclude --budget 30"] if nnodes >= 2 else [])
    assert "\n".join(ln for ln in lines if not ln.startswith("ran: ")) == expect, lines


def test_the_preflight_is_on_by_default_and_a_variable_turns_it_off():
    """Issue 28: on for every job (it runs for 2+ nodes only), `preflight: false` turns it off."""
    assert _preflight_block(TRAIN) and _preflight_block({**TRAIN, "preflight": True})
    assert not _preflight_block({**TRAIN, "preflight": False})


@pytest.mark.parametrize("nnodes,blamed,expect", [
    (4, "node3", "SRUN --nodes=3 --exclude=node3 --ntasks=3"),  # 3 left >= min_nodes 3: goes on without node3
    (3, "node3", "END 10 preflight --blamed node3"),  # 2 left < 3: requeued without it
    (4, "node1", "END 10 preflight --blamed node1"),  # the head node (the rendezvous) blamed: requeued
])
def test_with_min_nodes_the_training_goes_on_without_what_was_blamed(tmp_path, nnodes, blamed, expect):
    """Issue 28 item 3: where the job's node count allows (min_nodes), the training runs on the good nodes."""
    block = _preflight_block({**TRAIN, "min_nodes": 3})
    fake = tmp_path / "gpuguard"
    fake.write_text(f'#!/bin/bash\necho "{blamed}" >"$3"\nexit 10\n')
    fake.chmod(0o755)
    (tmp_path / "scontrol").write_text('#!/bin/bash\ntr , "\\n" <<<"$3"\n')  # show hostnames node1,node3
    (tmp_path / "scontrol").chmod(0o755)
    script = (f"PATH={tmp_path}:$PATH\nGPUGUARD={fake}\nATTEMPT_DIR={tmp_path}\nNNODES={nnodes}\nHEAD_NODE=node1\n"
              "EVENT=none\nEND_ARGS=(--max-failures 3)\nSRUN_EXCLUDE=()\n"
              'gpuguard_end() { echo "END $1 $EVENT ${END_ARGS[*]:2}"; exit 0; }\n' + block +
              'echo "SRUN --nodes=$NNODES ${SRUN_EXCLUDE[*]}"\n')
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == expect, (p.stdout, p.stderr)
    if expect.startswith("SRUN"):
        assert "goes on without it on 3 of 4 nodes (min_nodes 3)" in p.stderr
