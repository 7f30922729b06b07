"""`gpuguard lint` on real launch scripts from public repositories (tests/fixtures/templates/lint/, sources in
their headers), on environment dumps, and on what gpuguard itself renders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.templates import render_template
from gpuguard.templates.lint import lint, parse_assignments

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "lint"


def rules(text, **kw):
    return {(f.rule, f.severity) for f in lint(text, **kw)}


def test_old_p4d_recipe_on_the_current_stack():
    text = (FIX / "efa_legacy_train_dist.sh").read_text()
    # as written (FI_PROVIDER=efa + NCCL_PROTO=simple: AWS's preset for aws-ofi-nccl <= 1.5) only NCCL_DEBUG is bad
    assert {r for r, s in rules(text, instance="p4d.24xlarge") if s != "info"} == {"nccl-debug-info"}
    # on the current stack the same script pins the protocol (no tuner) and carries settings no longer needed
    modern = rules(text, instance="p4d.24xlarge", stack="efa")
    assert {("nccl-debug-info", "warn"), ("nccl-proto-set", "warn"), ("device-rdma-not-needed", "info"),
            ("fi-provider-not-needed", "info"), ("fi-efa-fork-safe", "info")} <= modern


def test_legacy_names_and_a_variable_nccl_never_reads():
    assert {("nccl-timeout", "warn"), ("legacy-blocking-wait", "warn")} <= rules((FIX / "nccl_timeout_run.sh").read_text())
    found = lint((FIX / "legacy_async_debug.sh").read_text())
    legacy = [f for f in found if f.rule == "legacy-async-error-handling"][0]
    assert legacy.line == 3 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in legacy.fix


def test_p2p_disable_and_debug_info():
    assert ("nccl-p2p-disable", "warn") in rules((FIX / "p2p_disable_run.sh").read_text())
    found = lint((FIX / "debug_start.sh").read_text())
    assert [(f.rule, f.line, f.value) for f in found] == [("nccl-debug-info", 3, "INFO")]


def test_socket_ifname_eth0_on_p5():
    script = "#!/bin/bash\n#SBATCH --constraint=p5.48xlarge\nexport NCCL_SOCKET_IFNAME=eth0\nsrun python t.py\n"
    f = [x for x in lint(script) if x.rule == "socket-ifname-eth0-p5"][0]
    assert f.severity == "error" and f.line == 3 and "p5.48xlarge" in f.message
    assert ("socket-ifname-eth0-p5", "info") in rules("export NCCL_SOCKET_IFNAME=eth0\n")  # instance unknown
    assert not any(r == "socket-ifname-eth0-p5" for r, _ in rules("export NCCL_SOCKET_IFNAME=eth0\n",
                                                                   instance="dgx-h100-ib"))
    assert not any(r == "socket-ifname-eth0-p5" for r, _ in rules(script.replace("eth0", "en")))


def test_dataloader_workers_on_efa_need_huge_pages_off():
    script = "#SBATCH --constraint=p4de.24xlarge\nsrun python train.py --num_workers 8\n"
    f = [x for x in lint(script) if x.rule == "missing-huge-page"][0]
    assert f.line == 2 and "num_workers 8" in f.message
    assert not any(x.rule == "missing-huge-page" for x in lint("export FI_EFA_USE_HUGE_PAGE=0\n" + script))
    assert not any(x.rule == "missing-huge-page" for x in lint(script.replace("8", "0")))


def test_assignment_forms():
    text = """export A=1 B="two words"
C=3 D=4 python x.py
env E=5 torchrun t.py
srun --export=ALL,F=6,G=7 a.out
mpirun -x H=8 -x I=9 b.out
declare -x J=10; unset A
# export K=commented
os.environ["L"] = "11"
echo M=12
NCCL_DEBUG=INFO \\
  python y.py
"""
    got = {(a.name, a.value) for a in parse_assignments(text)}
    assert {("A", "1"), ("B", "two words"), ("C", "3"), ("D", "4"), ("E", "5"), ("F", "6"), ("G", "7"), ("H", "8"),
            ("I", "9"), ("J", "10"), ("A", None), ("L", "11"), ("NCCL_DEBUG", "INFO")} <= got
    assert not any(n in ("K", "M") for n, _ in got)


def test_environment_dump_with_nul_separators():
    dump = b"PATH=/usr/bin\x00NCCL_DEBUG=TRACE\x00NCCL_ALGO=Tree\x00"
    assert {"nccl-debug-info", "nccl-algo-set"} <= {f.rule for f in lint(dump.decode())}


def test_unset_clears_an_earlier_setting():
    assert not lint("export NCCL_PROTO=LL128\nunset NCCL_PROTO\n")


@pytest.mark.parametrize("preset", ["p5.48xlarge", "p4d.24xlarge", "dgx-h100-ib", "generic"])
def test_rendered_scripts_are_clean(preset):
    text = render_template("torchrun.sbatch.j2", {"nodes": 4, "command": ["train.py", "--num_workers", "8"],
                                                  "preset": preset})
    assert [f for f in lint(text) if f.severity != "info"] == []


def test_cli_exit_codes_and_json(tmp_path):
    bad = tmp_path / "bad.sbatch"
    bad.write_text("export NCCL_DEBUG=INFO\n")
    good = tmp_path / "good.sbatch"
    good.write_text("export NCCL_DEBUG=WARN\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "gpuguard", "lint", *a], capture_output=True, text=True,
                                    timeout=60)
    p = run(str(bad))
    assert p.returncode == 1 and f"{bad}:1: warn [nccl-debug-info]" in p.stdout and "fix: export NCCL_DEBUG=WARN" in p.stdout
    p = run(str(good))
    assert p.returncode == 0 and "no known-bad" in p.stdout
    p = run("--json", str(bad))
    assert '"rule": "nccl-debug-info"' in p.stdout
