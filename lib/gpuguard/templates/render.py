"""Render gpuguard's sbatch templates: Jinja2 with StrictUndefined, every printed value shell-quoted
(`quoting.finalize`), and each template's variables declared in its header so that a missing or unknown
variable is an error that names it.

A template declares its variables in a header comment, which is also their documentation:

    {#- gpuguard:variables
    nodes: {type: int, min: 1, required: true, directive: true, help: "number of nodes"}
    partition: {type: str, default: null, directive: true, help: "Slurm partition (default: the cluster's)"}
    -#}

Types: str, int, bool, list (of strings; a string is split like a shell would, without expanding anything),
int_list, map (NAME: value), stack (a stack name or {libfabric, aws_ofi_nccl} versions), time (Slurm time
limit). `directive: true` marks values that go into `#SBATCH` or comment lines (no control characters).
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import jinja2
from markupsafe import Markup

from gpuguard.config.yamlutil import YamlError, load_yaml_text
from gpuguard.templates.containers import coverage_problem
from gpuguard.templates.presets import EnvVar, PresetError, job_env, resolve_preset
from gpuguard.templates.quoting import QuotingError, directive_safe, finalize, shell_word

ENV_TEMPLATES_DIR = "GPUGUARD_TEMPLATES_DIR"
_SPEC_RE = re.compile(r"\{#-?\s*gpuguard:variables\s*\n(.*?)\n\s*-?#\}", re.S)
_TIME_RE = re.compile(r"^(?:\d+-\d{1,2}(?::\d{1,2}(?::\d{1,2})?)?|\d+(?::\d{1,2}(?::\d{1,2})?)?|UNLIMITED|INFINITE)$")
TYPES = ("str", "int", "bool", "list", "int_list", "map", "stack", "time")


class TemplateError(ValueError):
    """A template could not be rendered: the message names the template and the variable or line at fault."""


@dataclass(frozen=True)
class VariableSpec:
    name: str
    type: str
    help: str
    required: bool = False
    default: Any = None
    directive: bool = False
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    choices: Optional[tuple[Any, ...]] = None
    pattern: Optional[str] = None


# --------------------------------------------------------------------------- where templates live


def template_dirs(extra: Optional[Iterable[str]] = None) -> list[Path]:
    """Search order: explicit/config dirs, $GPUGUARD_TEMPLATES_DIR, the checkout's sbatch_templates/, then
    share/gpuguard/sbatch_templates under the installation prefix."""
    dirs: list[Path] = [Path(d) for d in (extra or []) if d]
    if os.environ.get(ENV_TEMPLATES_DIR):
        dirs.append(Path(os.environ[ENV_TEMPLATES_DIR]))
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "sbatch_templates").is_dir() and (parent / "lib" / "gpuguard").is_dir():
            dirs.append(parent / "sbatch_templates")
            break
    prefix = Path(sys.prefix)
    for base in (prefix, *prefix.parents[:3], Path("/usr/local"), Path("/usr")):
        cand = base / "share" / "gpuguard" / "sbatch_templates"
        if cand.is_dir():
            dirs.append(cand)
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d not in seen:
            seen.append(d)
    return seen


def list_template_names(dirs: Sequence[Path]) -> list[str]:
    names: set[str] = set()
    for d in dirs:
        names.update(p.name for p in d.glob("*.j2") if not p.name.startswith("_"))
    return sorted(names)


def _comment(value: Any) -> Markup:
    """Text for a `# ...` line: inert in bash whatever it says, as long as it stays on one line."""
    directive_safe(str(value), "comment")
    return Markup(str(value))


def _sbatch(value: Any) -> Markup:
    directive_safe(value, "#SBATCH value")
    return finalize(value)


def _fail(message: str) -> None:
    raise TemplateError(message)


def make_environment(dirs: Sequence[Path]) -> jinja2.Environment:
    """The environment for these template directories, shared by every Renderer of this process: a template is
    compiled once (~25 ms), not once per render, and recompiled when its file changes (Jinja's auto_reload)."""
    return _environment(tuple(str(d) for d in dirs))


@functools.lru_cache(maxsize=16)
def _environment(dirs: tuple[str, ...]) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(list(dirs)),
        undefined=jinja2.StrictUndefined,
        autoescape=True,  # with `finalize`: every printed value is quoted; only our macros' Markup is not
        finalize=finalize,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    # No way around the quoting from inside a template.
    for name in ("safe", "forceescape", "escape", "e", "urlize", "xmlattr"):
        env.filters.pop(name, None)
    env.filters["comment"] = _comment
    env.filters["sbatch"] = _sbatch
    env.filters["word"] = lambda v: Markup(shell_word(v))
    env.filters["basename"] = lambda v: os.path.basename(str(v))
    env.globals["fail"] = _fail
    return env


# --------------------------------------------------------------------------- variable declarations


def parse_spec(source: str, template: str) -> dict[str, VariableSpec]:
    m = _SPEC_RE.search(source)
    if not m:
        return {}
    try:
        raw = load_yaml_text(m.group(1), f"{template} (gpuguard:variables header)") or {}
    except YamlError as e:
        raise TemplateError(str(e)) from None
    specs: dict[str, VariableSpec] = {}
    for name, d in raw.items():
        if not isinstance(d, dict) or d.get("type") not in TYPES or not d.get("help"):
            raise TemplateError(f"{template}: variable {name!r}: needs type ({', '.join(TYPES)}) and help")
        specs[name] = VariableSpec(name=name, type=d["type"], help=" ".join(str(d["help"]).split()),
                                   required=bool(d.get("required", False)), default=d.get("default"),
                                   directive=bool(d.get("directive", False)), minimum=d.get("min"),
                                   maximum=d.get("max"),
                                   choices=tuple(d["choices"]) if d.get("choices") else None,
                                   pattern=d.get("pattern"))
    return specs


def coerce(spec: VariableSpec, value: Any, where: str) -> Any:
    """Check (and normalise) one variable's value against its declaration. Pure."""
    what = f"{where}: variable '{spec.name}'"
    if value is None:
        if spec.required:
            raise TemplateError(f"{what} is required: {spec.help}")
        return None
    by_type = _COERCE.get(spec.type)
    if by_type is not None:
        value = by_type(spec, value, what)
    if spec.choices and value not in spec.choices:
        raise TemplateError(f"{what}: expected one of {', '.join(map(str, spec.choices))}, got {value!r}")
    if spec.directive:
        try:
            directive_safe(value, what)
        except QuotingError as e:
            raise TemplateError(str(e)) from None
    return value


# One checker per declared type: (spec, value, what) -> the normalised value, or TemplateError naming `what`.


def _as_str(spec: VariableSpec, value: Any, what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TemplateError(f"{what}: expected a string, got {value!r}")
    value = str(value)
    if spec.pattern and not re.fullmatch(spec.pattern, value):
        raise TemplateError(f"{what}: {value!r} does not match {spec.pattern}")
    return value


def _as_int(spec: VariableSpec, value: Any, what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            value = int(value)
        else:
            raise TemplateError(f"{what}: expected an integer, got {value!r}")
    if spec.minimum is not None and value < spec.minimum:
        raise TemplateError(f"{what}: expected an integer >= {spec.minimum}, got {value}")
    if spec.maximum is not None and value > spec.maximum:
        raise TemplateError(f"{what}: expected an integer <= {spec.maximum}, got {value}")
    return value


def _as_bool(spec: VariableSpec, value: Any, what: str) -> Any:
    if not isinstance(value, bool):
        raise TemplateError(f"{what}: expected true or false, got {value!r}")
    return value


def _as_list(spec: VariableSpec, value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            value = shlex.split(value)  # split like a shell would; nothing is expanded or executed
        except ValueError as e:
            raise TemplateError(f"{what}: cannot split {value!r}: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                              for v in value):
        raise TemplateError(f"{what}: expected a list of strings, got {value!r}")
    return [str(v) for v in value]


def _as_int_list(spec: VariableSpec, value: Any, what: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TemplateError(f"{what}: expected a list of integers, got {value!r}")
    if spec.minimum is not None and any(v < spec.minimum for v in value) or \
            spec.maximum is not None and any(v > spec.maximum for v in value):
        raise TemplateError(f"{what}: values must be within {spec.minimum}..{spec.maximum}, got {value}")
    return value


def _as_map(spec: VariableSpec, value: Any, what: str) -> Any:
    if not isinstance(value, Mapping):
        raise TemplateError(f"{what}: expected a mapping, got {value!r}")
    return dict(value)


def _as_stack(spec: VariableSpec, value: Any, what: str) -> Any:
    if not isinstance(value, (str, Mapping)):
        raise TemplateError(f"{what}: expected a stack name or {{libfabric: X, aws_ofi_nccl: Y}}, got {value!r}")
    return value


def _as_time(spec: VariableSpec, value: Any, what: str) -> Any:
    value = str(value).strip()
    if not _TIME_RE.match(value):
        raise TemplateError(f"{what}: not a Slurm time limit (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]): "
                            f"{value!r}")
    return value


_COERCE = {"str": _as_str, "int": _as_int, "bool": _as_bool, "list": _as_list, "int_list": _as_int_list,
           "map": _as_map, "stack": _as_stack, "time": _as_time}


def resolve_values(specs: Mapping[str, VariableSpec], values: Mapping[str, Any], template: str) -> dict[str, Any]:
    """Defaults + given values, every name known, every value checked. Pure."""
    unknown = [k for k in values if k not in specs]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), list(specs), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise TemplateError(f"{template}: unknown variable '{k}'{hint}; known: {', '.join(sorted(specs))}")
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        raw = values[name] if name in values else spec.default
        if raw is None and spec.required:
            raise TemplateError(f"{template}: missing required variable '{name}': {spec.help}")
        out[name] = coerce(spec, raw, template)
    return out


def shutdown_timeout(grace_s: int, explicit: Optional[int] = None) -> int:
    """How long torchrun waits for its workers after forwarding SIGTERM: the checkpoint window. Slurm's USR1 comes
    `grace_s` (or up to a minute more) before the time limit; leave a margin for torchrun to exit and for the
    attempt to be recorded and requeued before the limit. Pure."""
    if explicit is not None:
        return explicit
    margin = min(30, max(5, grace_s // 10))
    return max(1, grace_s - margin)


FABRIC_CHECK_ENV = (
    ("NCCL_DEBUG", "INFO", None,
     "Fabric check: NCCL's INFO lines, narrowed to INIT and NET below and written to per-rank files, say which "
     "network it loaded (aws-ofi-nccl / IB, or a TCP socket fallback); nothing extra reaches the job's output."),
    ("NCCL_DEBUG_SUBSYS", "INIT,NET", None,
     "Only initialisation and network selection (NCCL docs: NCCL_DEBUG_SUBSYS), not every collective."),
    ("NCCL_DEBUG_FILE", "nccl/%h.%p.log", "attempt_dir",
     "One file per rank (%h host, %p pid; NCCL docs) in this attempt's directory: gpuguard job-attempt fabric reads "
     "them, and NCCL warnings are kept there for the post-mortem."),
)


def _computed(values: dict[str, Any], template: str, site_presets: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """What templates derive from the variables: the preset's environment (plus the fabric check's and the job's
    own `env`), split into what the batch script exports and what each node exports under its private scratch
    directory, the preset's version warnings and torchrun's shutdown timeout."""
    gg: dict[str, Any] = {"template": template}
    for pattern in values.get("no_retry_patterns") or []:
        try:
            re.compile(pattern)
        except re.error as e:
            raise TemplateError(f"{template}: variable 'no_retry_patterns': bad regular expression {pattern!r}: "
                                f"{e}") from None
    if "preset" in values:
        try:
            preset = resolve_preset(values["preset"], values.get("stack"), site_presets)
            extra = job_env(values.get("env") or {})
        except PresetError as e:
            raise TemplateError(f"{template}: {e}") from None
        env: dict[str, EnvVar] = {e.name: e for e in preset.env}
        fabric_check = bool(values.get("fabric_check")) and preset.fabric in ("efa", "ib")
        if fabric_check:
            for name, value, under, why in FABRIC_CHECK_ENV:
                env[name] = EnvVar(name=name, value=value, why=why, under=under, source="template")
        if values.get("nvls_enable") is not None:
            on = bool(values["nvls_enable"])
            env["NCCL_NVLS_ENABLE"] = EnvVar(
                name="NCCL_NVLS_ENABLE", value="1" if on else "0", source="template",
                why=("NVLink SHARP (NVLS) " + ("on" if on else "off") + " as the job asked (nvls_enable): NCCL turns "
                     "it on by default where the NVSwitches support it, and aws-ofi-nccl's release notes report it "
                     "both helping and hurting performance"))
        for e in extra:
            env[e.name] = e
        gg.update(preset=preset, env=[e for e in env.values() if e.under != "local_dir"],
                  local_env=[e for e in env.values() if e.under == "local_dir"],
                  unset=[u for u in preset.unset if u.name not in env], warnings=list(preset.warnings),
                  fabric_check=fabric_check)
    if values.get("container_image"):
        problem = coverage_problem("checkpoint_dir", values.get("checkpoint_dir"),
                                   values.get("container_mounts") or [], [values.get("local_dir") or ""])
        if problem:
            gg.setdefault("warnings", []).append(problem + " (the job checks it on the nodes and stops if so)")
    output, name = str(values.get("output") or ""), str(values.get("job_name") or "")
    if "%x" in output and "/" in name:
        raise TemplateError(f"{template}: variable 'job_name': {name!r} contains '/', and output {output!r} puts the "
                            "job name (%x) into a file name: Slurm would fail the job without any output file")
    if "checkpoint_dir" in values and not values["checkpoint_dir"]:
        gg.setdefault("warnings", []).append(
            "checkpoint_dir is not set: the job is never given a checkpoint to resume from, so every requeue (the "
            "time limit's included) restarts the training from step 0")
    if "requeue_grace_s" in values:
        gg["shutdown_timeout_s"] = shutdown_timeout(values["requeue_grace_s"], values.get("shutdown_timeout_s"))
        if gg["shutdown_timeout_s"] >= values["requeue_grace_s"]:
            gg.setdefault("warnings", []).append(
                f"shutdown_timeout_s {gg['shutdown_timeout_s']} >= requeue_grace_s {values['requeue_grace_s']}: a "
                "checkpoint that uses the whole window runs into the time limit and the attempt may not be recorded")
    return gg


# --------------------------------------------------------------------------- rendering


class Renderer:
    def __init__(self, dirs: Optional[Sequence[Path]] = None, site_presets: Optional[Mapping[str, Any]] = None,
                 extra_dirs: Optional[Iterable[str]] = None) -> None:
        self.dirs = list(dirs) if dirs is not None else template_dirs(extra_dirs)
        self.env = make_environment(self.dirs)
        self.site_presets = site_presets

    def names(self) -> list[str]:
        return list_template_names(self.dirs)

    def _source(self, name: str) -> str:
        if name.startswith("_") or "/" in name or name not in self.names():
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise TemplateError(f"no template {name!r}{hint}; available: {', '.join(self.names()) or 'none'} "
                                f"(searched {', '.join(map(str, self.dirs)) or 'nothing'})")
        assert self.env.loader is not None
        return self.env.loader.get_source(self.env, name)[0]

    def variables(self, name: str) -> dict[str, VariableSpec]:
        return parse_spec(self._source(name), name)

    def render(self, name: str, values: Mapping[str, Any]) -> str:
        specs = parse_spec(self._source(name), name)
        resolved = resolve_values(specs, values, name)
        context = dict(resolved)
        context["gg"] = _computed(resolved, name, self.site_presets)
        try:
            return self.env.get_template(name).render(context)
        except jinja2.UndefinedError as e:
            raise TemplateError(f"{name}: {e.message} (declare it in the gpuguard:variables header)") from None
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"{e.filename or name}: line {e.lineno}: {e.message}") from None
        except QuotingError as e:
            raise TemplateError(f"{name}: {e}") from None
