"""`gpuguard lint`: known-bad NCCL/EFA/PyTorch settings in an sbatch script or an environment dump.

Pure functions: `parse_assignments(text)` finds every variable a script or dump sets (export/declare -x,
plain and command-prefix assignments, `env A=B cmd`, `--export=ALL,A=B`, mpirun `-x A=B`, `unset`, Python
`os.environ[...] = ...`, `env` / `/proc/PID/environ` dumps); `lint(text, ...)` applies the rules in
`data/lint_rules.yaml` and returns findings with the reason and the fix. Nothing is executed.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import yaml

RULES_PATH = Path(__file__).resolve().parent / "data" / "lint_rules.yaml"
SEVERITIES = ("error", "warn", "info")
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ASSIGN = re.compile(rf"^({_NAME})=(.*)$", re.S)
_PY_ENV = re.compile(rf"""os\.environ\[\s*['"]({_NAME})['"]\s*\]\s*=\s*(['"])(.*?)\2""")
_PY_SETDEFAULT = re.compile(rf"""os\.environ\.setdefault\(\s*['"]({_NAME})['"]\s*,\s*(['"])(.*?)\2""")
_PRESET_LINE = re.compile(r"^#\s*Preset:\s*(\S+)\s*/\s*(\S+?):?(\s|$)", re.M)
_CONSTRAINT = re.compile(r"^#SBATCH\s+(?:--constraint[= ]|-C\s*)(\S+)", re.M)
_WORKERS = re.compile(r"(num_workers|num-workers|dataloader_num_workers|dataloader-num-workers)['\"]?\s*[=: ]\s*['\"]?"
                      r"([1-9]\d*)")


@dataclass(frozen=True)
class Assignment:
    name: str
    value: Optional[str]  # None: unset
    line: int
    text: str


@dataclass(frozen=True)
class LintFinding:
    rule: str
    severity: str
    line: Optional[int]
    var: Optional[str]
    value: Optional[str]
    message: str
    why: str
    fix: str


# --------------------------------------------------------------------------- parsing


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations; keep the number of the first physical line."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for i, raw in enumerate(text.replace("\x00", "\n").splitlines(), 1):
        if not buf:
            start = i
        if raw.endswith("\\") and not raw.endswith("\\\\"):
            buf += raw[:-1] + " "
            continue
        out.append((start, buf + raw))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def _split(line: str) -> list[str]:
    try:
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        lex.commenters = "#"
        return list(lex)
    except ValueError:  # unbalanced quotes: fall back to whitespace words
        return line.split()


def _from_export_list(spec: str, line: int, text: str) -> list[Assignment]:
    out = []
    for part in spec.split(","):
        m = _ASSIGN.match(part)
        if m:
            out.append(Assignment(m.group(1), m.group(2), line, text))
    return out


def parse_assignments(text: str) -> list[Assignment]:
    found: list[Assignment] = []
    for lineno, line in _logical_lines(text):
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            for rx in (_PY_ENV, _PY_SETDEFAULT):
                for m in rx.finditer(line):
                    found.append(Assignment(m.group(1), m.group(3), lineno, stripped))
        if stripped.startswith("#"):
            m = re.match(r"^#SBATCH\s+--export=(\S+)", stripped)
            if m:
                found.extend(_from_export_list(m.group(1), lineno, stripped))
            continue
        words = _split(line)
        i = 0
        at_command_start = True
        while i < len(words):
            w = words[i]
            if w in (";", "&&", "||", "|", "&", "(", ")"):
                at_command_start = True
                i += 1
                continue
            if at_command_start and w in ("export", "declare", "typeset", "readonly", "local"):
                i += 1
                while i < len(words) and words[i] not in (";", "&&", "||", "|", "&"):
                    m = _ASSIGN.match(words[i])
                    if m:
                        found.append(Assignment(m.group(1), m.group(2), lineno, stripped))
                    i += 1
                continue
            if at_command_start and w == "unset":
                i += 1
                while i < len(words) and words[i] not in (";", "&&", "||", "|", "&"):
                    if re.fullmatch(_NAME, words[i]):
                        found.append(Assignment(words[i], None, lineno, stripped))
                    i += 1
                continue
            m = _ASSIGN.match(w)
            if m and (at_command_start or (i > 0 and words[i - 1] == "env") or
                      (i > 0 and _ASSIGN.match(words[i - 1]) is not None)):
                found.append(Assignment(m.group(1), m.group(2), lineno, stripped))
                i += 1
                continue
            if w.startswith("--export="):
                found.extend(_from_export_list(w[len("--export="):], lineno, stripped))
            elif w == "--export" and i + 1 < len(words):
                found.extend(_from_export_list(words[i + 1], lineno, stripped))
            elif w == "-x" and i + 1 < len(words) and _ASSIGN.match(words[i + 1]):  # mpirun -x A=B
                m2 = _ASSIGN.match(words[i + 1])
                assert m2
                found.append(Assignment(m2.group(1), m2.group(2), lineno, stripped))
            at_command_start = w == "env"
            i += 1
    return found


def final_environment(assignments: list[Assignment]) -> dict[str, Assignment]:
    """The last assignment of each variable still in force (an `unset` removes it)."""
    env: dict[str, Assignment] = {}
    for a in assignments:
        if a.value is None:
            env.pop(a.name, None)
        else:
            env[a.name] = a
    return env


# --------------------------------------------------------------------------- rules


@lru_cache(maxsize=1)
def load_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, list):
        raise ValueError(f"{RULES_PATH}: expected `rules:` with a list")
    for r in rules:
        missing = {"id", "severity", "message", "why", "fix"} - set(r)
        if missing or r["severity"] not in SEVERITIES or not ("var" in r or "check" in r):
            raise ValueError(f"{RULES_PATH}: rule {r.get('id')!r} is incomplete ({sorted(missing)})")
    return rules


def _instance_fabric(instance: Optional[str]) -> Optional[str]:
    if not instance:
        return None
    try:
        from gpuguard.templates.presets import load_presets

        inst = load_presets()["instances"].get(instance)
        if inst:
            return str(inst.get("fabric"))
    except Exception:  # noqa: BLE001 - lint must work even with broken presets
        pass
    if re.match(r"^(p4d|p4de|p5|p5e|p5en|p6|trn1|trn2)", instance):
        return "efa"
    return None


def _context(text: str, env: dict[str, Assignment], instance: Optional[str], stack: Optional[str],
             fabric: Optional[str]) -> tuple[Optional[str], Optional[str], Optional[str]]:
    m = _PRESET_LINE.search(text)
    if m:
        instance = instance or m.group(1)
        stack = stack or m.group(2)
    if not instance:
        for c in _CONSTRAINT.findall(text):
            for feat in re.split(r"[&|,\[\]*]", c.strip("'\"")):
                if _instance_fabric(feat):
                    instance = feat
                    break
    fabric = fabric or _instance_fabric(instance)
    if not fabric and any(n.startswith("FI_") for n in env):
        fabric = "efa"
    if not stack and fabric == "efa":
        if env.get("FI_PROVIDER") and env.get("NCCL_PROTO", Assignment("", "", 0, "")).value.lower() == "simple":
            stack = "efa-ofi-1.5"  # the script follows AWS's preset for aws-ofi-nccl <= 1.5
    return instance, stack, fabric


def lint(text: str, instance: Optional[str] = None, stack: Optional[str] = None,
         fabric: Optional[str] = None) -> list[LintFinding]:
    """Findings for `text` (an sbatch script, a shell file, or an environment dump), most severe first."""
    assignments = parse_assignments(text)
    env = final_environment(assignments)
    instance, stack, fabric = _context(text, env, instance, stack, fabric)
    findings: list[LintFinding] = []
    for rule in load_rules():
        if rule.get("when_fabric") and rule["when_fabric"] != fabric:
            continue
        if rule.get("when_stack") and stack not in rule["when_stack"]:
            continue
        if rule.get("unless_stack") and stack in rule["unless_stack"]:
            continue
        severity = rule["severity"]
        if rule.get("when_instance"):
            if instance is None:
                if not rule.get("when_instance_unknown"):
                    continue
                severity = rule["when_instance_unknown"]
            elif not any(fnmatch.fnmatch(instance, g) for g in rule["when_instance"]):
                continue
        if rule.get("check") == "missing_huge_page":
            workers = _WORKERS.search(text)
            hp = env.get("FI_EFA_USE_HUGE_PAGE")
            if workers and (hp is None or hp.value != "0"):
                line = text.count("\n", 0, workers.start()) + 1
                findings.append(_finding(rule, severity, line, "FI_EFA_USE_HUGE_PAGE", hp.value if hp else None,
                                         instance, f"{workers.group(0)}"))
            continue
        for name, a in env.items():
            if not fnmatch.fnmatchcase(name, rule["var"]) or name in rule.get("not_vars", ()):
                continue
            if rule.get("equals") and (a.value or "").strip().lower() not in [str(v).lower() for v in rule["equals"]]:
                continue
            findings.append(_finding(rule, severity, a.line, name, a.value, instance, None))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (order[f.severity], f.line or 0))


def _finding(rule: dict[str, Any], severity: str, line: Optional[int], var: Optional[str], value: Optional[str],
             instance: Optional[str], evidence: Optional[str]) -> LintFinding:
    fmt = {"value": value if value is not None else "", "var": var or "", "instance": instance or "this instance"}
    msg = rule["message"].format(**fmt)
    if evidence:
        msg += f" ({evidence})"
    return LintFinding(rule=rule["id"], severity=severity, line=line, var=var, value=value, message=msg,
                       why=rule["why"], fix=rule["fix"].format(**fmt))


def format_findings(findings: list[LintFinding], source: str) -> str:
    lines = []
    for f in findings:
        where = f"{source}:{f.line}" if f.line else source
        lines.append(f"{where}: {f.severity} [{f.rule}] {f.message}")
        lines.append(f"    why: {f.why}")
        lines.append(f"    fix: {f.fix}")
    return "\n".join(lines)
