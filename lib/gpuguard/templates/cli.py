"""Commands: `gpuguard render`, `gpuguard templates {list,show,presets}`, `gpuguard lint`. (`gpuguard job-attempt`,
what rendered batch scripts call, is gpuguard.templates.jobattempt_cli: it imports no Jinja.)"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from dataclasses import asdict
from typing import Any, Mapping, Optional

from gpuguard.siteconfig import load_config
from gpuguard.config.yamlutil import YamlError, load_yaml_text
from gpuguard.templates.lint import format_findings, lint
from gpuguard.config.sections.templates import TemplatesConfig
from gpuguard.templates.presets import list_presets, resolve_preset
from gpuguard.templates.render import Renderer, TemplateError
from gpuguard.util.cliargs import add_config_option
from gpuguard.util.fs import atomic_write

COMMANDS = ("render", "templates", "lint")


def add_parser(sub: Any) -> None:
    _add_render(sub)
    _add_templates(sub)
    _add_lint(sub)


def _add_render(sub: Any) -> None:
    p = sub.add_parser("render", help="render an sbatch template (torchrun, nccl-tests) from a job YAML")
    add_config_option(p)
    p.add_argument("template", help="template name, e.g. torchrun.sbatch.j2 (gpuguard templates list)")
    p.add_argument("-c", "--values", dest="values_file", metavar="JOB_YAML", help="job variables (YAML mapping)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="set a variable (YAML value: 4, true, [a, b]); KEY may be dotted: env.FOO=1")
    p.add_argument("-o", "--output", help="write here (mode 0755) instead of stdout")
    p.add_argument("--no-lint", action="store_true", help="do not lint the rendered script")


def _add_templates(sub: Any) -> None:
    p = sub.add_parser("templates", help="list sbatch templates, show a template's variables, list presets")
    add_config_option(p)
    ts = p.add_subparsers(dest="templates_cmd", metavar="SUBCOMMAND")
    s = ts.add_parser("list", help="the templates that can be rendered")
    add_config_option(s)
    s = ts.add_parser("show", help="a template's variables: type, default, help")
    add_config_option(s)
    s.add_argument("name")
    s = ts.add_parser("presets", help="environment presets (instance types and stacks), or one preset's variables")
    add_config_option(s)
    s.add_argument("name", nargs="?", help="instance type / profile")
    s.add_argument("--stack", help="stack name (default: the instance's first), or versions such as "
                                   "aws_ofi_nccl=1.14.0,efa_installer=1.28.0,nccl=2.21.5")


def _add_lint(sub: Any) -> None:
    p = sub.add_parser("lint", help="flag known-bad NCCL/EFA settings in an sbatch script or environment dump")
    add_config_option(p)
    p.add_argument("files", nargs="+", metavar="FILE", help="script or `env` dump ('-' for stdin)")
    p.add_argument("--instance-type", help="instance type the job runs on (default: from the script)")
    p.add_argument("--stack", help="software stack (efa, efa-ofi-1.6, efa-ofi-1.5, ib, none)")
    p.add_argument("--json", action="store_true")


# --------------------------------------------------------------------------- value parsing (pure)


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set key=value` (value parsed as YAML; dotted keys nest) -> mapping. Errors name the item."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        bad = [part for part in key.split(".") if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part)]
        if bad:
            raise ValueError(f"--set {item!r}: {bad[0]!r} is not a valid name (letters, digits and '_', not starting "
                             "with a digit; '.' separates nested keys, e.g. env.WANDB_PROJECT=x)")
        try:
            value = load_yaml_text(raw, f"--set {key}") if raw.strip() else ""
        except YamlError:
            value = raw  # not YAML: take it as a plain string
        if isinstance(value, (dict, list)) is False and not isinstance(value, (str, int, float, bool)) \
                and value is not None:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"--set {item!r}: {part} is not a mapping")
            node = nxt
        node[parts[-1]] = value
    return out


def merge_values(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win; mappings (env) merge key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in layer.items():
            if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
                out[k] = merge_values(out[k], v)
            else:
                out[k] = v
    return out


def site_defaults(defaults: Mapping[str, Any], template: str, declared: set[str], known_templates: list[str]) -> \
        dict[str, Any]:
    """`templates.defaults` for one template: top-level keys apply to every template that declares them; a key
    named after a template holds defaults for that template only. A key no template knows is an error."""
    out: dict[str, Any] = {}
    for k, v in defaults.items():
        if k in known_templates:
            if not isinstance(v, Mapping):
                raise ValueError(f"templates.defaults.{k}: expected a mapping of variables")
            if k == template:
                out.update(v)
        elif k in declared:
            out[k] = v
    return out


def _load_values_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    try:
        data = load_yaml_text(text, path)
    except YamlError as e:
        raise ValueError(f"not valid YAML: {e}") from None  # e names the file and the line
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of template variables")
    return data


# --------------------------------------------------------------------------- commands


def cmd_render(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    tcfg = cfg.templates
    renderer = Renderer(site_presets=tcfg.presets or None,
                        extra_dirs=[tcfg.dir] if tcfg.dir else None)
    declared = set(renderer.variables(args.template))
    all_declared: set[str] = set()
    for name in renderer.names():
        all_declared |= set(renderer.variables(name))
    defaults = dict(tcfg.defaults or {})
    for k in defaults:
        if k not in all_declared and k not in renderer.names():
            raise TemplateError(f"{cfg.source}: templates.defaults.{k}: no template declares this variable")
    values = merge_values(site_defaults(defaults, args.template, declared, renderer.names()),
                          _load_values_file(args.values_file) if args.values_file else {}, parse_set(args.sets))
    text = renderer.render(args.template, values)
    for line in text.splitlines():
        if line.startswith("# WARNING: "):
            print(f"gpuguard render: {line[2:]}", file=sys.stderr)
    if not args.no_lint:
        findings = [f for f in lint(text) if f.severity != "info"]
        if findings:
            print(format_findings(findings, f"{args.template} (rendered)"), file=sys.stderr)
        if any(f.severity == "error" for f in findings):
            print("gpuguard render: not written: the rendered script has a known-bad setting (error above); fix the "
                  "values, or render with --no-lint to write it anyway", file=sys.stderr)
            return 1
    if args.output:
        out = Path(args.output)
        atomic_write(out, text, mode=0o755)
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_templates(args: argparse.Namespace) -> int:
    cfg = load_config(args.config) if args.config else None
    tcfg = cfg.templates if cfg else TemplatesConfig()
    renderer = Renderer(site_presets=tcfg.presets or None,
                        extra_dirs=[tcfg.dir] if tcfg.dir else None)
    sub = args.templates_cmd or "list"
    if sub == "list":
        for name in renderer.names():
            specs = renderer.variables(name)
            required = [s.name for s in specs.values() if s.required]
            print(f"{name:<24} {len(specs)} variables (required: {', '.join(required) or 'none'})")
        print(f"# from {', '.join(map(str, renderer.dirs))}")
        return 0
    if sub == "show":
        for s in renderer.variables(args.name).values():
            default = "(required)" if s.required else json.dumps(s.default)
            print(f"{s.name:<22} {s.type:<8} {default:<22} {s.help}")
        return 0
    if sub == "presets":
        site = tcfg.presets or None
        if not args.name:
            for name, inst in list_presets(site).items():
                print(f"{name:<20} stacks: {', '.join(inst['stacks']):<28} {inst.get('description', '')}")
            return 0
        stack: Any = args.stack
        if stack and "=" in stack:  # versions: aws_ofi_nccl=1.14.0,efa_installer=1.28.0,nccl=2.21.5
            stack = dict(part.split("=", 1) for part in stack.split(",") if "=" in part)
        p = resolve_preset(args.name, stack, site)
        print(f"# {p.label}: {p.description}\n# stack {p.stack}: {p.stack_description}")
        for w in p.warnings:
            print(f"# WARNING: {w}")
        for e in p.env:
            where = {"job_dir": "$JOB_DIR/", "attempt_dir": "$ATTEMPT_DIR/",
                     "local_dir": "$LOCAL_DIR/"}.get(e.under or "", "")
            print(f"{e.name}={where}{e.value}\n    # {e.why}")
        for u in p.unset:
            print(f"unset {u.name}\n    # {u.why}")
        return 0
    print("usage: gpuguard templates {list,show,presets}", file=sys.stderr)
    return 2


def cmd_lint(args: argparse.Namespace) -> int:
    worst = 0
    report: dict[str, Any] = {}
    for path in args.files:
        try:
            data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
        except OSError as e:
            print(f"gpuguard lint: {path}: cannot read: {e}", file=sys.stderr)
            return 2
        findings = lint(data.decode("utf-8", errors="replace"), instance=args.instance_type, stack=args.stack)
        report[path] = [asdict(f) for f in findings]
        if any(f.severity in ("error", "warn") for f in findings):
            worst = 1
        if not args.json:
            if findings:
                print(format_findings(findings, path))
            else:
                print(f"{path}: no known-bad NCCL/EFA settings")
    if args.json:
        print(json.dumps(report, indent=2))
    return worst


def run(args: argparse.Namespace) -> int:
    handlers = {"render": cmd_render, "templates": cmd_templates, "lint": cmd_lint}
    return handlers[args.cmd](args)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m gpuguard.templates.cli ...`: these commands without the rest of the CLI."""
    ap = argparse.ArgumentParser(prog="gpuguard")
    add_config_option(ap, top_level=True)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    add_parser(sub)
    args = ap.parse_args(argv)
    if args.cmd not in COMMANDS:
        ap.print_help()
        return 2
    try:
        return run(args)
    except ValueError as e:
        print(f"gpuguard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
