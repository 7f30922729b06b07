"""Scaffold a new check in its four places (ARCHITECTURE.md, "Adding a check"):

    python -m devtools.newcheck gpu.persistence PERSIST --probe nvml --module gpu/identity \\
        --description "persistence mode is on on every GPU"

1. the function: a skeleton appended to lib/gpuguard/checks/<module>.py (pure: observations in, findings out), its
   id named in the module's docstring;
2. its fixture test: an entry in the registry test's table of failing fixtures, a placeholder that fails until a
   real failing observation replaces it (every check must have one);
3. its registry entry: a `CheckSpec` in lib/gpuguard/checks/registered.py, in the group that holds the module's
   other checks, with the next free priority (after every other check: move it up if it is a root cause);
4. its documentation: its section in docs/runbooks.md (the anchor the registry test looks for) and its row in
   README's check table (with its keyword in README's list), both with TODOs the registry test refuses; a prolog
   check is also counted in README's demo description (the checks the demo's healthy prolog passes).

It edits the files in place (a checkout, never an installed package) and prints what it did; `--dry-run` only
prints. Nothing else needs editing: keywords, priorities, node scope and what the probe reads are derived from the
registry entry.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PROBES = ("nvml", "kernel_log", "fabric", "system", "nccl", "dcgm", "efa_counters")
KINDS = {"all": "ALL_KINDS", "node": "NODE", "idle": "IDLE_ONLY"}
PROLOG_KINDS = ("all", "node", "idle")  # the kinds whose checks a prolog runs (README's check table)
TODO = "TODO"


def function_text(func: str, check_id: str, probe: str) -> str:
    obs_field = {"kernel_log": "kernel_log", "efa_counters": "efa_counters"}.get(probe, probe)
    return f'''

def {func}(obs: Observations, inp: CheckInput) -> list[Finding]:
    """{check_id}: {TODO} say what it checks. A configuration choice warns (evidence mismatch=True), something that
    could not be read is incomplete (never ok), only unambiguous hardware evidence fails."""
    s = spec_of(inp)
    if obs.{obs_field} is None:
        return [incomplete(s, "{probe} not read")]
    raise NotImplementedError("{check_id}: judge obs.{obs_field} here")
'''


def spec_text(check_id: str, keyword: str, probe: str, module_alias: str, func: str, kinds: str, description: str,
              priority: int) -> str:
    return (f'        CheckSpec("{check_id}", ("{keyword}",), "{probe}", {module_alias}.{func}, {KINDS[kinds]}, {{}},\n'
            f'                  "{description}", priority={priority}),\n')


def runbook_text(check_id: str, keyword: str, description: str) -> str:
    return (f'<a id="{check_id}"></a>\n### {check_id} ({keyword})\n\n{description[:1].upper() + description[1:]}.\n'
            f"{TODO}: what the finding means on a real node, how to confirm it by hand, and what to do (the action in\n"
            "the drain reason).\n\n")


def readme_row(check_id: str, keyword: str) -> str:
    return f"| {check_id} | {keyword} | {TODO}: drains when (— if never) | {TODO}: warns when | {TODO}: action |\n"


def failing_text(check_id: str) -> str:
    return (f'    "{check_id}": [(lambda: _todo("{check_id}: a real failing observation, with its source"),\n'
            + " " * (len(check_id) + 10) + 'P5, {}, None)],\n')


def next_priority(registry_src: str) -> int:
    """After every registered check: a new check is not a root cause until someone says so."""
    return max((int(p) for p in re.findall(r"priority=(\d+)", registry_src)), default=0) + 10


def _registry_test(root: Path) -> Path:
    for p in sorted((root / "tests").rglob("test_*.py")):
        if "FAILING: dict[str, list[Case]]" in p.read_text():
            return p
    raise SystemExit("no registry test with a FAILING table found under tests/")


def _validate(check_id: str, keyword: str, probe: str, kinds: str) -> None:
    if not re.fullmatch(r"[a-z]+\.[a-z_]+", check_id) or not re.fullmatch(r"[A-Z]+", keyword):
        raise SystemExit("check id like gpu.persistence, keyword like PERSIST (upper-case letters)")
    if probe not in PROBES:
        raise SystemExit(f"--probe: one of {', '.join(PROBES)}")
    if kinds not in KINDS:
        raise SystemExit(f"--kinds: one of {', '.join(sorted(KINDS))}")


def scaffold(root: Path, check_id: str, keyword: str, probe: str, module: str, kinds: str, description: str,
             dry_run: bool = False) -> list[str]:
    """Edit the four places; returns what was done (one line each)."""
    _validate(check_id, keyword, probe, kinds)
    func = "check_" + check_id.split(".", 1)[1]
    checks = root / "lib" / "gpuguard" / "checks"
    mod_path, reg_path = checks / f"{module}.py", checks / "registered.py"
    test_path, runbooks, readme = _registry_test(root), root / "docs" / "runbooks.md", root / "README.md"
    reg = reg_path.read_text()
    if f'CheckSpec("{check_id}"' in reg:
        raise SystemExit(f"{check_id} is registered already")
    alias = _module_alias(reg, module)
    spec = spec_text(check_id, keyword, probe, alias, func, kinds, description, next_priority(reg))
    test_src = test_path.read_text()
    if "def _todo(" not in test_src:
        raise SystemExit(f"{test_path.relative_to(root)} has no _todo() for a placeholder fixture")
    table = test_src.index("FAILING: dict[str, list[Case]]")
    edits = [(mod_path, _named_in_docstring(mod_path.read_text(), check_id) + function_text(func, check_id, probe)),
             (test_path, test_src[:table] + _with_failing_entry(test_src[table:], check_id)),
             (reg_path, _insert_in_group(reg, alias, spec)),
             (runbooks, _with_runbook(runbooks.read_text(), check_id, runbook_text(check_id, keyword, description)))]
    if kinds in PROLOG_KINDS:
        edits.append((readme, _with_readme_row(readme.read_text(), check_id, keyword)))
    done = []
    for path, text in edits:
        done.append(f"{'would edit' if dry_run else 'edited'} {path.relative_to(root)}")
        if not dry_run:
            path.write_text(text)
    return done


def _module_alias(registry_src: str, module: str) -> str:
    """The name the registry imports the check module under (gpu/identity -> identity)."""
    name = module.replace("/", ".").split(".")[-1]
    if re.search(rf"\bimport [^\n]*\b{re.escape(name)}\b", registry_src):
        return name
    raise SystemExit(f"checks/registered.py does not import checks.{module.replace('/', '.')}: add the import there "
                     "first")


def _named_in_docstring(module_src: str, check_id: str) -> str:
    """The module with `check_id` added to its docstring's first paragraph (which names the module's checks)."""
    start = module_src.index('"""') + 3
    end = module_src.index('"""', start)
    blank = module_src.find("\n\n", start)
    para = module_src[start:end if blank < 0 or blank > end else blank].rstrip()
    body, stop = (para[:-1], ".") if para.endswith(".") else (para, "")
    sep = "\n" if len(body.rsplit("\n", 1)[-1]) + len(check_id) + 6 > 120 else " "  # the line stays <= 120
    named = f"{body},{sep}{check_id}{stop}"
    return module_src[:start] + named + module_src[start + len(para):]


def _insert_in_group(registry_src: str, alias: str, spec: str) -> str:
    """`spec` as the last item of the registry group that holds the module's other checks (the last group when none
    does): a list that closes with `    ]` on its own line before the registry's derived tables."""
    tables = registry_src.index("\n# ----")
    last_use = registry_src.rfind(f" {alias}.", 0, tables)
    i = registry_src.find("\n    ]\n", last_use) if last_use >= 0 else -1
    if i < 0 or i > tables:
        i = registry_src.rindex("\n    ]\n", 0, tables)
    return registry_src[:i + 1] + spec + registry_src[i + 1:]


def _with_failing_entry(table_src: str, check_id: str) -> str:
    end = table_src.index("\n}\n")
    return table_src[:end + 1] + failing_text(check_id) + table_src[end + 1:]


def _with_runbook(runbooks_src: str, check_id: str, section: str) -> str:
    """The section after the last one of the same family (gpu., sys., ...), else before the first section that is
    not a check's (`gpuguard`), else at the end."""
    last = runbooks_src.rfind(f'<a id="{check_id.split(".", 1)[0]}.')
    if last >= 0:
        cuts = [p for p in (runbooks_src.find("\n<a id=", last), runbooks_src.find("\n## ", last)) if p >= 0]
        at = min(cuts) + 1 if cuts else -1
    else:
        at = runbooks_src.find('<a id="gpuguard"></a>')
    if at < 0:
        return runbooks_src.rstrip("\n") + "\n\n" + section
    return runbooks_src[:at] + section + runbooks_src[at:]


def _with_readme_row(readme_src: str, check_id: str, keyword: str) -> str:
    """README's check table ("What the prolog checks") with the check's row after the last row of its family, and
    its keyword in the list under "Drain reasons" when it is a new one."""
    head = readme_src.index("\n| check | keyword |") + 1
    end = readme_src.index("\n\n", head)
    lines = readme_src[head:end].split("\n")  # the header, the rule, the rows
    family = [k for k, line in enumerate(lines) if k >= 2 and line.startswith(f"| {check_id.split('.', 1)[0]}.")]
    lines.insert((family[-1] if family else len(lines) - 1) + 1, readme_row(check_id, keyword).rstrip("\n"))
    out = readme_src[:head] + "\n".join(lines) + readme_src[end:]
    marker = " (each check declares its own"
    listed = out[out.index("Keywords: ") + len("Keywords: "):out.index(marker)]
    if keyword not in re.findall(r"[A-Z]+", listed):
        out = out.replace(marker, f", {keyword}{marker}", 1)
    return _counted_in_demo(out)


def _counted_in_demo(readme_src: str) -> str:
    """README's demo description with one more check in "the prolog passes (N checks": a prolog check passes on
    the demo's healthy nodes (tests/unit/test_newcomer.py compares N with what that prolog reports)."""
    demo = readme_src.find("## What `make demo` shows")
    m = re.compile(r"\((\d+) checks").search(readme_src, demo) if demo >= 0 else None
    if m is None or readme_src.find("\n## ", demo + 1) < m.start():
        return readme_src
    return readme_src[:m.start(1)] + str(int(m.group(1)) + 1) + readme_src[m.end(1):]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.newcheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check_id", help="e.g. gpu.persistence")
    ap.add_argument("keyword", help="drain keyword, e.g. PERSIST")
    ap.add_argument("--probe", required=True, choices=PROBES, help="the observation it judges")
    ap.add_argument("--module", required=True, help="checks module, e.g. gpu/identity or system")
    ap.add_argument("--kinds", choices=sorted(KINDS), default="idle",
                    help="run kinds: all, node (not the epilog), idle (prolog, health check, manual; default)")
    ap.add_argument("--description", default=f"{TODO}: one line, what a passing node looks like")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to edit (default: this one)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    for line in scaffold(args.root, args.check_id, args.keyword, args.probe, args.module, args.kinds,
                         args.description, args.dry_run):
        print(line)
    print("next: write the function, a real failing fixture in the registry test, the runbook section and the README "
          f"row (every {TODO} above); then `pytest tests/unit/test_check_registry.py`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
