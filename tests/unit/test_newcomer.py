"""What a newcomer meets first (issue 29 item 12): `make demo` on a fresh cloud machine whose unattended-upgrades
holds the dpkg lock at boot, a README whose demo description matches what the demo prints, and demo lines that
end on a whole word."""

from __future__ import annotations

import re
from pathlib import Path

from simnode import SCENARIOS, ctx, make_cfg, run_sim

from devtools import demo

ROOT = Path(__file__).resolve().parents[2]


def apt_get_calls(text: str) -> list[str]:
    """Every apt-get command line (not the words in an error message) of a Makefile or shell script."""
    return [m.group(0) for m in re.finditer(r"apt-get\s+(?:-\S+\s+|\S+=\S+\s+)*(?:update|install)\b[^;&|\n]*", text)
            if not re.search(r"(need root to|echo)[^\n]*" + re.escape(m.group(0)), text)]


def test_every_apt_get_waits_for_the_dpkg_lock_instead_of_failing():
    found = 0
    for path in (ROOT / "Makefile", ROOT / ".ci" / "run"):
        for call in apt_get_calls(path.read_text()):
            found += 1
            assert "DPkg::Lock::Timeout=" in call, f"{path.name}: {call!r} fails at once when another apt runs"
    assert found >= 5  # deps installs slurm, shellcheck, locales, postgresql/prometheus, alertmanager, pgbouncer


def readme_demo_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## What `make demo` shows", 1)[1].split("\n## ", 1)[0]


def test_the_readme_lists_the_steps_the_demo_prints():
    steps = re.findall(r"^(\d+)\. ", readme_demo_section(), re.M)
    assert [int(s) for s in steps] == list(range(1, demo.TOTAL_STEPS + 1)), steps


def test_the_readme_counts_the_checks_the_demos_prolog_reports(tmp_path):
    """The demo prints `N checks ok` for the healthy prolog (findings with severity ok): the README says N."""
    said = re.search(r"\((\d+) checks", readme_demo_section())
    assert said, "the README says how many checks the healthy prolog passes"
    cfg = make_cfg(tmp_path)
    result = run_sim(ctx("prolog"), cfg, simulate=str(SCENARIOS / "healthy-p5.yaml"))
    ok = sum(1 for f in result.findings if f.severity == "ok")
    assert int(said.group(1)) == ok, f"README says {said.group(1)} checks, the prolog passes {ok}"


def test_demo_lines_are_clipped_at_a_word_boundary_with_an_ellipsis():
    clip = demo.clip
    line = "last error: reading node state: scontrol show node failed (1): slurm_load_node error: Unable to contact"
    short = clip(line, 60)
    assert len(short) <= 60 and short.endswith("…")
    assert line.startswith(short[:-1].rstrip())
    assert line[len(short[:-1].rstrip())] == " ", short  # the cut falls between two words
    assert clip("fits", 60) == "fits"
    assert clip("", 60) == "(nothing)"  # never a line that ends in a colon and nothing
    assert clip("x" * 80, 20) == "x" * 19 + "…"  # one long word: cut it, still marked
