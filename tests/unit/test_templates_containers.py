"""Containers (issue 16): a checkpoint_dir no container mount covers rendered silently, and inside the container the
directory was empty, so every attempt restarted from step 0. Now the render warns, and each node checks, inside
the container, that it sees the batch script's marker in checkpoint_dir before starting torchrun."""

from __future__ import annotations

import subprocess

import pytest

from gpuguard.templates import render_template
from gpuguard.templates.attempts import DEFAULT_NO_RETRY, no_retry_match
from gpuguard.templates.containers import coverage_problem, parse_mount

IMAGE = "nvcr.io#nvidia/pytorch:25.01-py3"


def test_parse_mount():
    assert parse_mount("/fsx:/fsx:ro") == ("/fsx", "/fsx")
    assert parse_mount("/fsx") == ("/fsx", "/fsx")
    assert parse_mount("/lustre/u:/data") == ("/lustre/u", "/data")


@pytest.mark.parametrize("path,mounts,auto,problem", [
    ("/fsx/run/ckpt", ["/fsx:/fsx"], [], None),
    ("/fsx/run/ckpt", ["/fsx/run/ckpt"], [], None),
    ("/fsx/run/ckpt", ["/data:/data", "/fsx/run:/fsx/run:ro"], [], None),
    ("/tmp/ckpt", [], ["/tmp"], None),                                  # under the auto-mounted scratch root
    ("/fsx/run/ckpt", [], ["/tmp"], "is not covered by any container mount"),
    ("/fsx/run/ckpt", ["/fsxx:/fsxx"], [], "is not covered"),            # a prefix of the name is not a parent
    ("/fsx/run/ckpt", ["/lustre/u:/fsx"], [], "mounted from another host path"),
    ("ckpt", ["/fsx:/fsx"], [], "is relative"),
    (None, [], [], None),
])
def test_coverage(path, mounts, auto, problem):
    got = coverage_problem("checkpoint_dir", path, mounts, auto)
    assert (got is None) if problem is None else (problem in got), got


def test_render_warns_about_an_uncovered_checkpoint_dir():
    base = {"nodes": 2, "command": ["train.py"], "container_image": IMAGE, "checkpoint_dir": "/fsx/run/ckpt"}
    text = render_template("torchrun.sbatch.j2", base)
    assert "# WARNING: checkpoint_dir /fsx/run/ckpt is not covered by any container mount" in text
    covered = render_template("torchrun.sbatch.j2", dict(base, container_mounts=["/fsx:/fsx"]))
    assert "not covered" not in covered and "GPUGUARD_CKPT_MARKER" in covered
    # without a container nothing to say
    plain = render_template("torchrun.sbatch.j2", {k: v for k, v in base.items() if k != "container_image"})
    assert "# WARNING: checkpoint_dir" not in plain and "GPUGUARD_CKPT_MARKER=" not in plain


def test_gpuguard_render_prints_the_warning(tmp_path):
    import sys

    cfg = tmp_path / "config.yaml"
    cfg.write_text("logging: {syslog: false}\n")
    values = tmp_path / "job.yaml"
    values.write_text(f"nodes: 2\ncommand: [train.py]\ncontainer_image: '{IMAGE}'\ncheckpoint_dir: /fsx/ckpt\n")
    p = subprocess.run([sys.executable, "-m", "gpuguard", "render", "torchrun.sbatch.j2", "-c", str(values), "-o",
                        str(tmp_path / "job.sbatch")], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "GPUGUARD_CONFIG": str(cfg)})
    assert "gpuguard render: WARNING: checkpoint_dir /fsx/ckpt is not covered" in p.stderr, p.stderr


def test_a_node_that_cannot_see_checkpoint_dir_stops_and_is_not_retried(tmp_path):
    """Inside the container the marker the batch script wrote into checkpoint_dir is missing: the node stops
    before torchrun, with a message that job-attempt end treats as no-retry (every attempt would start over)."""
    text = render_template("torchrun.sbatch.j2", {"nodes": 1, "command": ["t.py"], "container_image": IMAGE,
                                                  "checkpoint_dir": "/fsx/ckpt", "local_dir": str(tmp_path)})
    funcs = text[text.index("gpuguard_node() {"):text.index("gpuguard_is_loopback()")]
    (tmp_path / "node.sh").write_text(funcs + '\ngpuguard_node "$@"\n')
    fake = tmp_path / "torchrun"
    fake.write_text("#!/bin/bash\n[ \"$1\" = --help ] && echo --shutdown-timeout && exit 0\ntouch \"$OUT/ran\"\n")
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "9", "SLURMD_NODENAME": "node1", "ATTEMPT_DIR": str(tmp_path),
           "GPUGUARD_LOCAL_ROOT": str(tmp_path), "OUT": str(tmp_path), "GPUGUARD_VISIBLE_WAIT_S": "0"}
    marker = tmp_path / "ckpt" / ".gpuguard-visible-9-1"
    p = subprocess.run(["bash", str(tmp_path / "node.sh"), str(fake)], capture_output=True, text=True, timeout=30,
                       env={**env, "GPUGUARD_CKPT_MARKER": str(marker)})
    assert p.returncode == 1 and not (tmp_path / "ran").exists()
    assert f"checkpoint_dir {marker.parent} is not visible inside the container" in p.stderr
    hit = no_retry_match("0: " + p.stderr.strip().splitlines()[-1], DEFAULT_NO_RETRY)
    assert hit and "restart from step 0" in hit[1]
    marker.parent.mkdir()
    marker.touch()
    p = subprocess.run(["bash", str(tmp_path / "node.sh"), str(fake)], capture_output=True, text=True, timeout=30,
                       env={**env, "GPUGUARD_CKPT_MARKER": str(marker)})
    assert p.returncode == 0 and (tmp_path / "ran").exists(), p.stderr
