"""`gpuguard lint`: known-bad NCCL/EFA/PyTorch settings in an sbatch script or an environment dump.

Pure functions: `parse_assignments(text)` (gpuguard.templates.shellvars) finds every variable a script or dump
sets; `lint(text, ...)` applies the rules in `data/lint_rules.yaml` and returns findings with the reason and the
fix. Nothing is executed.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from gpuguard.config.yamlutil import load_yaml_file
from gpuguard.templates.presets import load_presets
from gpuguard.templates.shellvars import Assignment, final_environment, parse_assignments

RULES_PATH = Path(__file__).resolve().parent / "data" / "lint_rules.yaml"
SEVERITIES = ("error", "warn", "info")
_PRESET_LINE = re.compile(r"^#\s*Preset:\s*(\S+)\s*/\s*(\S+?):?(\s|$)", re.M)
_CONSTRAINT = re.compile(r"^#SBATCH\s+(?:--constraint[= ]|-C\s*)(\S+)", re.M)
_WORKERS = re.compile(r"(num_workers|num-workers|dataloader_num_workers|dataloader-num-workers)['\"]?"
                      r"(?:[ \t]*[=:][ \t]*|[ \t]+)['\"]?([1-9]\d*)")
# an nccl-tests run (a validation job, where NCCL_DEBUG=INFO is what you want)
_NCCL_TESTS = re.compile(r"\b(?:all_reduce|all_gather|alltoall|broadcast|reduce_scatter|reduce|sendrecv|scatter|gather|"
                         r"hypercube)_perf(?:_mpi)?\b")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE", "ABORT")


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


# --------------------------------------------------------------------------- rules


@lru_cache(maxsize=1)
def load_rules() -> list[dict[str, Any]]:
    data = load_yaml_file(RULES_PATH)
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, list):
        raise ValueError(f"{RULES_PATH}: expected `rules:` with a list")
    for r in rules:
        missing = {"id", "severity", "message", "why", "fix"} - set(r)
        if missing or r["severity"] not in SEVERITIES or not ("var" in r or "check" in r):
            raise ValueError(f"{RULES_PATH}: rule {r.get('id')!r} is incomplete ({sorted(missing)})")
    return rules


def _instance_info(instance: Optional[str]) -> tuple[Optional[str], list[str]]:
    """(fabric, supported stacks) of a known instance type or profile; (None, []) when unknown."""
    if not instance:
        return None, []
    try:
        inst = load_presets()["instances"].get(instance)
        if inst:
            return str(inst.get("fabric")), list(inst.get("stacks") or [])
    except Exception:  # noqa: BLE001 - lint must work even with broken presets
        pass
    if re.match(r"^(p4d|p4de|p5|p5e|p5en|p6|p6e|trn1|trn2)[.-]", instance):
        return "efa", []
    return None, []


def _instance_fabric(instance: Optional[str]) -> Optional[str]:
    return _instance_info(instance)[0]


def _value(env: dict[str, Assignment], name: str) -> str:
    a = env.get(name)
    return (a.value or "").strip() if a else ""


def _context(text: str, env: dict[str, Assignment], instance: Optional[str], stack: Optional[str],
             fabric: Optional[str]) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """The instance, stack and fabric a script runs on: from the arguments, else the rendered script's `# Preset:`
    line, `#SBATCH --constraint`, the instance's only supported stack, and the variables it sets (FI_EFA_* or
    FI_PROVIDER=efa: EFA; NCCL_IB_*: InfiniBand)."""
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
    inst_fabric, inst_stacks = _instance_info(instance)
    fabric = fabric or inst_fabric
    if not fabric:
        if any(n.startswith("FI_EFA_") for n in env) or _value(env, "FI_PROVIDER").lower() == "efa":
            fabric = "efa"
        elif any(n.startswith("NCCL_IB_") for n in env if not (n == "NCCL_IB_DISABLE" and _value(env, n) == "1")):
            fabric = "ib"
    if not stack and len(inst_stacks) == 1:
        stack = inst_stacks[0]  # e.g. p5: only the current EFA stack exists there
    if not stack and fabric == "efa":
        if env.get("FI_PROVIDER") and _value(env, "NCCL_PROTO").lower() == "simple":
            stack = "efa-ofi-1.5"  # the script follows AWS's preset for aws-ofi-nccl <= 1.5
    return instance, stack, fabric


def _exempt(rule: dict[str, Any], text: str, env: dict[str, Assignment]) -> bool:
    for cond in rule.get("unless", ()):
        if cond == "nccl_tests" and _NCCL_TESTS.search(text):
            return True
        if cond == "debug_to_file" and env.get("NCCL_DEBUG_FILE") and _value(env, "NCCL_DEBUG_SUBSYS") \
                and "ALL" not in _value(env, "NCCL_DEBUG_SUBSYS").upper():
            return True  # narrow logging into per-rank files (gpuguard's fabric check), not the job's output
    return False


def _ib_hca_prefix_trap(value: str) -> Optional[str]:
    """NCCL_IB_HCA entries are prefixes unless the list starts with `=` (`^=` when excluding): `mlx5_1` also
    selects mlx5_10..mlx5_19. Returns the entries that can match more than meant, or None."""
    v = value.strip()
    if v.startswith("^"):
        v = v[1:]
    if v.startswith("="):
        return None
    risky = [e.split(":")[0] for e in v.split(",") if e.split(":")[0][-1:].isdigit()]
    return ", ".join(f"{r} also matches {r}0-{r}9" for r in risky[:4]) if risky else None


def lint(text: str, instance: Optional[str] = None, stack: Optional[str] = None,
         fabric: Optional[str] = None) -> list[LintFinding]:
    """Findings for `text` (an sbatch script, a shell file, or an environment dump), most severe first. Linear in
    the size of `text`."""
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
        if _exempt(rule, text, env):
            continue
        severity = rule["severity"]
        if rule.get("when_instance"):
            if instance is None:
                unknown = rule.get("when_instance_unknown")
                if not unknown or (rule.get("unknown_needs_fabric") and rule["unknown_needs_fabric"] != fabric):
                    continue
                severity = unknown
            elif not any(fnmatch.fnmatch(instance, g) for g in rule["when_instance"]):
                continue
        check = rule.get("check")
        if check == "missing_huge_page":
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
            value = (a.value or "").strip()
            evidence = None
            if check == "ib_hca_prefix":
                evidence = _ib_hca_prefix_trap(value)
                if not evidence:
                    continue
            if rule.get("equals") and value.lower() not in [str(v).lower() for v in rule["equals"]]:
                continue
            if rule.get("not_in") and value.upper() in [str(v).upper() for v in rule["not_in"]]:
                continue
            if not _in_range(rule, value):
                continue
            findings.append(_finding(rule, severity, a.line, name, a.value, instance, evidence))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (order[f.severity], f.line or 0))


def _in_range(rule: dict[str, Any], value: str) -> bool:
    """`below: N` / `at_least: N`: a rule about a size; a value that is not a plain integer (a shell variable, a
    typo) matches neither, so a size rule never fires on what it cannot read."""
    if "below" not in rule and "at_least" not in rule:
        return True
    if not re.fullmatch(r"\d{1,19}", value):
        return False
    number = int(value)
    return ("below" not in rule or number < int(rule["below"])) and \
        ("at_least" not in rule or number >= int(rule["at_least"]))


def _finding(rule: dict[str, Any], severity: str, line: Optional[int], var: Optional[str], value: Optional[str],
             instance: Optional[str], evidence: Optional[str]) -> LintFinding:
    v = (value or "").strip()
    fmt = {"value": value if value is not None else "", "var": var or "", "instance": instance or "this instance",
           "ib_hca_exact": ("^=" + v[1:].lstrip("=")) if v.startswith("^") else "=" + v.lstrip("=")}
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
