"""devtools/newcheck.py: adding a check is its four places (ARCHITECTURE.md). Scaffolded into a copy of this
checkout, the registry still imports, the new check is registered in its module's group with its derived tables and
a priority the registry's invariants accept, and the registry test fails exactly where a person still has to write
something (the failing fixture, the runbook section, the README row): no test that cannot fail.

The check scaffolded here has an id and keyword no real check or documented example uses, so the test holds
whatever is registered (ARCHITECTURE.md's example included)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK_ID, KEYWORD = "testonly.scaffolded", "TESTONLYSCAFFOLD"


def _newcheck(copy: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "devtools.newcheck", CHECK_ID, KEYWORD, "--probe", "nvml",
                           "--module", "gpu/identity", "--root", str(copy), *extra], cwd=copy, capture_output=True,
                          text=True, timeout=60)


def _demo_count(readme: Path) -> int:
    return int(re.search(r"\((\d+) checks", readme.read_text().split("## What `make demo` shows", 1)[1]).group(1))


@pytest.mark.slow(8)  # a copy of the checkout, three interpreters and a pytest run in it
def test_a_scaffolded_check_is_registered_and_its_fixture_must_be_written(tmp_path):
    copy = tmp_path / "repo"
    for part in ("lib", "devtools", "docs", "tests", "examples"):
        # with the compiled modules (their sources keep their times, so an edited module is compiled anew)
        shutil.copytree(ROOT / part, copy / part)
    for name in ("setup.cfg", "README.md"):
        (copy / name).write_text((ROOT / name).read_text())
    before = {p: p.read_text() for p in copy.rglob("*") if p.is_file() and p.suffix in (".py", ".md")}
    run = _newcheck(copy, "--description", "the scaffold's own test check")
    assert run.returncode == 0, run.stderr
    changed = sorted(str(p.relative_to(copy)) for p, text in before.items() if p.read_text() != text)
    assert changed == ["README.md", "docs/runbooks.md", "lib/gpuguard/checks/gpu/identity.py",
                       "lib/gpuguard/checks/registered.py", "tests/unit/test_check_registry.py"]
    assert sorted(re.findall(r"^edited (\S+)$", run.stdout, re.M)) == changed
    # README's demo description counts the checks the healthy prolog passes (tests/unit/test_newcomer.py): one more
    assert _demo_count(copy / "README.md") == _demo_count(ROOT / "README.md") + 1
    env = {"PYTHONPATH": f"{copy / 'lib'}:{copy}", "PATH": "/usr/bin:/bin"}
    # registered with its derived tables, in the group of gpu/identity's checks (after the last of them)
    probe = ("from gpuguard.checks import get_check, node_scope, registry\n"
             "from gpuguard.slurm.reason import valid_keyword\n"
             f"s = get_check('{CHECK_ID}'); ids = [c.id for c in registry()]\n"
             f"print(s.keyword, s.scope, '{CHECK_ID}' in node_scope(), valid_keyword('{KEYWORD}'),\n"
             f"      registry()[ids.index('{CHECK_ID}') - 1].func.__module__ == 'gpuguard.checks.gpu.identity')")
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [KEYWORD, "node", "True", "True", "True"], out.stderr
    assert f'<a id="{CHECK_ID}"></a>' in (copy / "docs" / "runbooks.md").read_text()
    # its own --basetemp: by default the inner session would number its directory beside this session's under
    # /tmp/pytest-of-<user> and, keeping only the newest three, delete older runs' trees there (25 s of unlink
    # and rmdir seen on a machine that had run the suite a few times)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--basetemp", str(tmp_path / "inner-tmp"), "tests/unit/test_check_registry.py"],
                         cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    failed = sorted(re.findall(r"^FAILED \S+::(\S+)", res.stdout, re.M))
    # what is left to write fails; the priority, docstring and vocabulary invariants already hold
    assert failed == [f"test_checks_emit_only_keywords_their_spec_declares[{CHECK_ID}]",
                      f"test_every_check_is_described_in_one_place[{CHECK_ID}]",
                      "test_readme_lists_the_checks_the_registry_has"], res.stdout[-3000:]
    assert "NotImplementedError" in res.stdout
    again = _newcheck(copy)
    assert again.returncode != 0 and "registered already" in again.stderr
