"""devtools/newcheck.py: adding a check is its four places (ARCHITECTURE.md). Scaffolded into a copy of this
checkout, the registry still imports, the new check is registered with its derived tables, and the registry test
fails until a real failing fixture replaces the placeholder (no test that cannot fail)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow(8)  # a copy of the checkout, three interpreters and a pytest run in it
def test_a_scaffolded_check_is_registered_and_its_fixture_must_be_written(tmp_path):
    copy = tmp_path / "repo"
    for part in ("lib", "devtools", "docs", "tests", "examples"):
        # with the compiled modules (their sources keep their times, so an edited module is compiled anew)
        shutil.copytree(ROOT / part, copy / part)
    (copy / "setup.cfg").write_text((ROOT / "setup.cfg").read_text())
    run = subprocess.run([sys.executable, "-m", "devtools.newcheck", "gpu.persistence", "PERSIST", "--probe", "nvml",
                          "--module", "gpu/identity", "--description", "persistence mode is on on every GPU",
                          "--root", str(copy)], cwd=copy, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("edited") == 4
    env = {"PYTHONPATH": f"{copy / 'lib'}:{copy}", "PATH": "/usr/bin:/bin"}
    probe = ("from gpuguard.checks import get_check, node_scope, check_keywords\n"
             "from gpuguard.slurm.reason import valid_keyword\n"
             "s = get_check('gpu.persistence')\n"
             "print(s.keyword, s.scope, 'gpu.persistence' in node_scope(), valid_keyword('PERSIST'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["PERSIST", "node", "True", "True"], out.stderr
    assert '<a id="gpu.persistence"></a>' in (copy / "docs" / "runbooks.md").read_text()
    registry_test = next(p for p in (copy / "tests").rglob("test_*.py")
                         if "FAILING: dict[str, list[Case]]" in p.read_text())
    # its own --basetemp: by default the inner session would number its directory beside this session's under
    # /tmp/pytest-of-<user> and, keeping only the newest three, delete older runs' trees there (25 s of unlink
    # and rmdir seen on a machine that had run the suite a few times)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--basetemp", str(tmp_path / "inner-tmp"), str(registry_test), "-k", "persistence"],
                         cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "NotImplementedError" in res.stdout, res.stdout[-2000:]
    again = subprocess.run([sys.executable, "-m", "devtools.newcheck", "gpu.persistence", "PERSIST", "--probe",
                            "nvml", "--module", "gpu/identity", "--root", str(copy)], cwd=copy, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode != 0 and "registered already" in again.stderr
