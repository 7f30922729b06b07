"""sbatch templates: multi-node torchrun and nccl-tests jobs with tuned NCCL/EFA environments, auto-requeue and
resume (`gpuguard render`, `gpuguard templates`, `gpuguard lint`, `gpuguard job-attempt`).

Public API (other features render through it):

    render_template("nccl-tests.sbatch.j2", {"nodes": 2, "binary": "/opt/nccl-tests/build/all_reduce_perf"})
    list_templates()  # ["nccl-tests.sbatch.j2", "torchrun.sbatch.j2"]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

if TYPE_CHECKING:
    from gpuguard.templates.render import Renderer, TemplateError, VariableSpec

__all__ = ["render_template", "list_templates", "template_variables", "TemplateError", "VariableSpec"]


def __getattr__(name: str) -> Any:
    """TemplateError and VariableSpec on first use: the hooks load the `templates:` section
    (gpuguard.config.sections.templates) on every run, and must not import jinja2 for it."""
    if name in ("Renderer", "TemplateError", "VariableSpec"):
        from gpuguard.templates import render

        return getattr(render, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _renderer(**kw: Any) -> Renderer:
    from gpuguard.templates.render import Renderer

    return Renderer(**kw)


def render_template(name: str, values: Mapping[str, Any], *, template_dirs: Optional[Iterable[str]] = None,
                    site_presets: Optional[Mapping[str, Any]] = None) -> str:
    """Render template `name` with `values`. Raises TemplateError naming any missing or unknown variable (or
    a value that is not allowed, e.g. a newline in an #SBATCH value). Every value in the output is shell-quoted."""
    return _renderer(site_presets=site_presets, extra_dirs=template_dirs).render(name, values)


def list_templates(*, template_dirs: Optional[Iterable[str]] = None) -> list[str]:
    """Names of the job templates that can be rendered (shared `_*.j2` parts are not listed)."""
    return _renderer(extra_dirs=template_dirs).names()


def template_variables(name: str, *, template_dirs: Optional[Iterable[str]] = None) -> dict[str, VariableSpec]:
    """The variables template `name` declares: type, default, whether required, and help text."""
    return _renderer(extra_dirs=template_dirs).variables(name)
