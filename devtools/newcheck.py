"""Scaffold a new check in its four places (ARCHITECTURE.md, "Adding a check"):

    python -m devtools.newcheck gpu.persistence PERSIST --probe nvml --module gpu/identity \\
        --description "persistence mode is on on every GPU"

1. a function skeleton appended to lib/gpuguard/checks/<module>.py (pure: observations in, findings out);
2. its `CheckSpec` in lib/gpuguard/checks/registered.py, after the last one (the last group: move it to the
   group it belongs to), with the next free priority (lower = named first in a drain reason: move it up if it is a
   root cause);
3. its entry in the registry test's table of failing fixtures: a placeholder that fails until a real failing
   observation replaces it (every check must have one);
4. its section in docs/runbooks.md (the anchor the registry test looks for).

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


def function_text(func: str, check_id: str, probe: str) -> str:
    obs_field = {"kernel_log": "kernel_log", "efa_counters": "efa_counters"}.get(probe, probe)
    return f'''

def {func}(obs: Observations, inp: CheckInput) -> list[Finding]:
    """{check_id}: TODO say what it checks. A configuration choice warns (evidence mismatch=True), something that
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
    return (f'\n<a id="{check_id}"></a>\n### {check_id} ({keyword})\n\n{description[:1].upper() + description[1:]}. '
            "TODO: what the finding means on a real node, how to confirm it by hand, and what to do (the action in "
            "the drain reason).\n")


def failing_text(check_id: str) -> str:
    return (f'    "{check_id}": [(lambda: _todo("{check_id}: a real failing observation, with its source"),\n'
            + " " * (len(check_id) + 8) + 'P5, {}, None)],\n')


def _next_priority(registry_src: str) -> int:
    return max((int(p) for p in re.findall(r"priority=(\d+)", registry_src)), default=0) + 10


def _registry_test(root: Path) -> Path:
    for p in sorted((root / "tests").rglob("test_*.py")):
        if "FAILING: dict[str, list[Case]]" in p.read_text():
            return p
    raise SystemExit("no registry test with a FAILING table found under tests/")


def scaffold(root: Path, check_id: str, keyword: str, probe: str, module: str, kinds: str, description: str,
             dry_run: bool = False) -> list[str]:
    """Edit the four places; returns what was done (one line each)."""
    if not re.fullmatch(r"[a-z]+\.[a-z_]+", check_id) or not re.fullmatch(r"[A-Z]+", keyword):
        raise SystemExit("check id like gpu.persistence, keyword like PERSIST (upper-case letters)")
    if probe not in PROBES:
        raise SystemExit(f"--probe: one of {', '.join(PROBES)}")
    func = "check_" + check_id.split(".", 1)[1]
    mod_path = root / "lib" / "gpuguard" / "checks" / f"{module}.py"
    reg_path = root / "lib" / "gpuguard" / "checks" / "registered.py"
    test_path = _registry_test(root)
    runbooks = root / "docs" / "runbooks.md"
    reg = reg_path.read_text()
    if f'CheckSpec("{check_id}"' in reg:
        raise SystemExit(f"{check_id} is registered already")
    alias = _module_alias(reg, module)
    done = []
    new_reg = _insert_at_last_list_end(reg, spec_text(check_id, keyword, probe, alias, func, kinds, description,
                                                      _next_priority(reg)))
    test_src = test_path.read_text()
    table = test_src.index("FAILING: dict[str, list[Case]]")
    new_test = test_src[:table] + _with_failing_entry(test_src[table:], check_id)
    edits = [(mod_path, mod_path.read_text() + function_text(func, check_id, probe)),
             (reg_path, new_reg), (test_path, _with_todo_helper(new_test)),
             (runbooks, runbooks.read_text() + runbook_text(check_id, keyword, description))]
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


def _insert_at_last_list_end(text: str, insert: str) -> str:
    """`insert` as the last item of the last registry group (the last list that closes with `    ]` on its own line
    before the registry's derived tables)."""
    i = text.rindex("\n    ]\n", 0, text.index("\n# ----"))
    return text[:i + 1] + insert + text[i + 1:]


def _with_failing_entry(table_src: str, check_id: str) -> str:
    end = table_src.index("\n}\n")
    return table_src[:end + 1] + failing_text(check_id) + table_src[end + 1:]


def _with_todo_helper(test_src: str) -> str:
    if "def _todo(" in test_src:
        return test_src
    helper = ('\n\ndef _todo(what: str) -> Observations:\n    """A scaffolded check\'s fixture, still to write '
              '(devtools/newcheck.py)."""\n    raise NotImplementedError(what)\n\n\n')
    i = test_src.index("\n\n# check id -> failing fixtures")
    return test_src[:i] + helper + test_src[i + 2:]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.newcheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check_id", help="e.g. gpu.persistence")
    ap.add_argument("keyword", help="drain keyword, e.g. PERSIST")
    ap.add_argument("--probe", required=True, choices=PROBES, help="the observation it judges")
    ap.add_argument("--module", required=True, help="checks module, e.g. gpu/identity or system")
    ap.add_argument("--kinds", choices=sorted(KINDS), default="idle",
                    help="run kinds: all, node (not the epilog), idle (prolog, health check, manual; default)")
    ap.add_argument("--description", default="TODO: one line, what a passing node looks like")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to edit (default: this one)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    for line in scaffold(args.root, args.check_id, args.keyword, args.probe, args.module, args.kinds,
                         args.description, args.dry_run):
        print(line)
    print("next: write the function, a real failing fixture in the registry test, the runbook text; then "
          "`pytest tests/unit -k registry`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
