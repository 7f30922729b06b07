"""The house rules a new maintainer can rely on (issue 15), checked on the source rather than promised in prose:
small modules, small functions, no import cycle, no private name borrowed across modules (in the package and in
devtools/ alike), the packages in layers that import only downwards (issue 30), and a `pip install .` that puts no
dev tooling and no tests on a compute node.

`python tests/unit/test_architecture.py` prints every module and function over its limit, every cycle, every
import against the layers and every borrowed private name, exempt ones included (marked), without running pytest."""

from __future__ import annotations

import ast
import functools
import shutil
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "gpuguard"
DEVTOOLS = "devtools"
ROOTS = (PACKAGE, DEVTOOLS)

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Generated or sourced data, not code: long by nature, and read by no one line by line. Permanent.
DATA_MODULES = {
    "gpuguard.xid.catalog_data": "NVIDIA's Xid table, built from its documentation",
}

# The packages of gpuguard (a top-level module counts as a package of its own), bottom first. A package imports only
# packages of lower layers or of its own layer, and the package graph has no cycle (so within a layer the imports
# run one way too). Every import counts: top-level, inside a function (the hot path's lazy imports) and under
# TYPE_CHECKING alike. ARCHITECTURE.md ("The layers") says what each layer is for.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("helpers", ("util",)),
    ("plain data", ("model", "context", "xid")),
    ("configuration", ("config",)),
    ("readers", ("profiles", "probes", "kernellog", "trainlog")),
    ("checks", ("checks",)),
    ("services", ("siteconfig", "slurm", "store", "fleet", "notify", "metrics")),
    ("job tooling", ("templates", "nccl")),
    ("pipeline", ("pipeline",)),
    ("around the pipeline", ("simulate", "preflight", "monitor")),
    ("entry points", ("cli", "agent", "watch", "__main__")),
]

# TEMPORARY: held back from the module-size rule only, each for the reason given. An entry goes when its module
# keeps the rule (the test below then fails until it is removed); never add one.
TEMPORARY_MODULE_SIZE: dict[str, str] = {}


# --------------------------------------------------------------------------------------------- what is checked


def package_modules() -> dict[str, Path]:
    """Every module of the package and of devtools/: dotted name -> file."""
    modules: dict[str, Path] = {}
    for base, root in ((REPO / "lib", PACKAGE), (REPO, DEVTOOLS)):
        for path in sorted((base / root).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass
class ModuleImports:
    """What one module takes from the rest of the package and devtools."""

    targets: set[str] = field(default_factory=set)  # modules it imports (top level, in a function, TYPE_CHECKING)
    private_names: list[str] = field(default_factory=list)  # "line: module._name" borrowed from another module


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def _parsed(path: Path, mtime_ns: int, size: int) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def parse(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per version of the file (three rules read every module)."""
    st = path.stat()
    return _parsed(path, st.st_mtime_ns, st.st_size)


def _imports_of(module: str, path: Path, modules: dict[str, Path]) -> ModuleImports:
    tree = parse(path)
    found = ModuleImports()
    aliases: dict[str, str] = {}  # local name -> module it stands for
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.targets.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            if source.split(".")[0] not in ROOTS:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.targets.add(submodule)
                    aliases[alias.asname or alias.name] = submodule
                    continue
                found.targets.add(source)
                if is_private(alias.name) and source != module:
                    found.private_names.append(f"{node.lineno}: {source}.{alias.name}")
    for node in ast.walk(tree):
        # module._name through an imported module is the same borrowing by another road
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and is_private(node.attr):
            target = aliases.get(node.value.id)
            if target and target != module:
                found.private_names.append(f"{node.lineno}: {target}.{node.attr}")
    found.targets.discard(module)
    return found


def import_graph() -> dict[str, ModuleImports]:
    modules = package_modules()
    return {name: _imports_of(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start in sorted(graph):
        if start in index:
            continue
        enter(start)
        work = [(start, iter(sorted(graph.get(start, ()))))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    enter(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = _pop_component(stack, on_stack, node)
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def _pop_component(stack: list[str], on_stack: set[str], root: str) -> list[str]:
    component = []
    while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == root:
            return component


@dataclass(frozen=True)
class PackageImport:
    """One import of a gpuguard module from another package: where it is and which packages it joins."""

    where: str  # "lib/gpuguard/config/parse.py:60"
    source: str  # importing package ("config")
    target: str  # imported package ("checks")
    module: str  # imported module ("gpuguard.checks")

    def __str__(self) -> str:
        return f"{self.where}: {self.source} -> {self.target} ({self.module})"


def package_of(module: str) -> str:
    """gpuguard.config.parse -> config; gpuguard.model -> model (a top-level module is a package of its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_imports(modules: dict[str, Path]) -> list[PackageImport]:
    """Every import, anywhere in a module, of a module of another gpuguard package."""
    found: list[PackageImport] = []
    for module, path in modules.items():
        if not module.startswith(PACKAGE + "."):
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [_absolute(module, path.name == "__init__.py", node)]
            else:
                continue
            for target in targets:
                if target.startswith(PACKAGE + ".") and package_of(target) != package_of(module):
                    where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}"
                    found.append(PackageImport(where, package_of(module), package_of(target), target))
    return found


def layer_of() -> dict[str, int]:
    return {package: i for i, (_, packages) in enumerate(LAYERS) for package in packages}


def upward_imports(imports: list[PackageImport], layers: dict[str, int]) -> list[str]:
    """Each import of a package from a higher layer, named by file:line, from -> to and the layers."""
    names = [name for name, _ in LAYERS]
    return [f"{i} imports layer '{names[layers[i.target]]}' from layer '{names[layers[i.source]]}' below it"
            for i in imports if i.source in layers and i.target in layers and layers[i.target] > layers[i.source]]


def package_cycles(imports: list[PackageImport]) -> list[str]:
    """Each cycle of the package graph, with the imports that make it."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        graph.setdefault(i.source, set()).add(i.target)
    out = []
    for cycle in import_cycles(graph):
        members = set(cycle)
        joins = sorted({f"{i.where}: {i.source} -> {i.target}" for i in imports if {i.source, i.target} <= members})
        out.append(" <-> ".join(cycle) + ": " + "; ".join(joins))
    return out


def long_functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines from `def` to its last line) of every function over the limit, nested ones too."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append((name, length))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(parse(path), "")
    return found


def module_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def modules_over_the_limit() -> dict[str, int]:
    return {name: module_lines(path) for name, path in package_modules().items()
            if name not in DATA_MODULES and module_lines(path) > MAX_MODULE_LINES}


# --------------------------------------------------------------------------------------------- the rules


def test_no_module_over_the_limit() -> None:
    too_long = {name: n for name, n in modules_over_the_limit().items() if name not in TEMPORARY_MODULE_SIZE}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {too_long}"


def test_no_function_over_the_limit() -> None:
    too_long = {f"{name}.{function}": length for name, path in package_modules().items()
                if name not in DATA_MODULES for function, length in long_functions(path)}
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {too_long}"


def test_no_import_cycle() -> None:
    cycles = import_cycles({name: imports.targets for name, imports in import_graph().items()})
    assert not cycles, "import cycles (top-level, function-level and TYPE_CHECKING imports alike): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_every_package_has_its_layer() -> None:
    modules = package_modules()
    packages = {package_of(m) for m in modules if m.startswith(PACKAGE + ".")}
    layers = layer_of()
    assert sum(len(p) for _, p in LAYERS) == len(layers), "a package is named in two layers"
    assert not packages - set(layers), f"packages with no layer (add them to LAYERS): {sorted(packages - set(layers))}"
    assert not set(layers) - packages, f"LAYERS names packages that are gone: {sorted(set(layers) - packages)}"


def test_packages_import_only_downwards() -> None:
    """config and model at the bottom, the features above, the entry points (cli, agent, watch) on top."""
    imports = package_imports(package_modules())
    upward = upward_imports(imports, layer_of())
    assert not upward, "imports against the layers (LAYERS, ARCHITECTURE.md):\n" + "\n".join(upward)


def test_no_package_cycle() -> None:
    cycles = package_cycles(package_imports(package_modules()))
    assert not cycles, "package import cycles (every import counts, inside functions too):\n" + "\n".join(cycles)


def test_no_private_name_imported_across_modules() -> None:
    borrowed = {name: imports.private_names for name, imports in import_graph().items() if imports.private_names}
    assert not borrowed, f"private names used from another module (make them public or move them): {borrowed}"


def test_exemptions_name_modules_that_still_need_them() -> None:
    """An exemption outlives its reason only by mistake: one whose module is gone or within the limit fails."""
    modules = package_modules()
    over = modules_over_the_limit()
    for name in DATA_MODULES:
        assert name in modules, f"{name} is gone: drop it from DATA_MODULES"
    for name, why in TEMPORARY_MODULE_SIZE.items():
        assert name in over, f"{name} keeps the size rule now ({why}): drop it from TEMPORARY_MODULE_SIZE"


# --------------------------------------------------------------------------------------------- the checkers fail


def test_the_cycle_finder_finds_cycles() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    assert import_cycles({"p": {"p.x"}, "p.x": {"p"}, "q": {"q"}}) == [["p", "p.x"]]


def test_the_layer_rules_name_the_offending_import(tmp_path: Path) -> None:
    modules = {"gpuguard.config.parse": tmp_path / "parse.py", "gpuguard.checks": tmp_path / "checks.py",
               "gpuguard.util.fs": tmp_path / "fs.py"}
    modules["gpuguard.config.parse"].write_text("import os\n\ndef f():\n    from gpuguard.checks import x\n")
    modules["gpuguard.checks"].write_text("from gpuguard.config.parse import f\nfrom gpuguard.util import fs\n")
    modules["gpuguard.util.fs"].write_text("")
    imports = package_imports(modules)
    assert sorted(str(i).split(": ", 1)[1] for i in imports) == ["checks -> config (gpuguard.config.parse)",
                                                                 "checks -> util (gpuguard.util)",
                                                                 "config -> checks (gpuguard.checks)"]
    [upward] = upward_imports(imports, layer_of())
    assert upward.endswith("parse.py:4: config -> checks (gpuguard.checks) imports layer 'checks' from layer "
                           "'configuration' below it"), upward
    [cycle] = package_cycles(imports)
    assert cycle.startswith("checks <-> config: ") and "parse.py:4: config -> checks" in cycle, cycle


def test_the_checkers_find_long_functions_and_private_imports(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "mod.py"
    source.write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n")
    assert long_functions(source) == [("long", MAX_FUNCTION_LINES + 1)]

    modules = {"gpuguard.a": tmp_path / "a.py", "gpuguard.b": tmp_path / "b.py", "devtools.c": tmp_path / "c.py"}
    modules["gpuguard.b"].write_text("def _hidden(): pass\n")
    modules["gpuguard.a"].write_text(
        "from gpuguard.b import _hidden\nimport gpuguard.b as b\n\ndef f():\n    return b._hidden()\n"
    )
    found = _imports_of("gpuguard.a", modules["gpuguard.a"], modules)
    assert found.targets == {"gpuguard.b"}
    assert found.private_names == ["1: gpuguard.b._hidden", "5: gpuguard.b._hidden"]
    modules["devtools.c"].write_text("def f():\n    from gpuguard.b import _hidden\n")
    found = _imports_of("devtools.c", modules["devtools.c"], modules)
    assert found.targets == {"gpuguard.b"} and found.private_names == ["2: gpuguard.b._hidden"]


def test_relative_imports_resolve_to_package_modules(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    modules = {"gpuguard.p": pkg / "__init__.py", "gpuguard.p.x": pkg / "x.py", "gpuguard.q": tmp_path / "q.py"}
    modules["gpuguard.p"].write_text("from . import x\nfrom ..q import thing\n")
    modules["gpuguard.p.x"].write_text("from . import _priv\n")
    assert _imports_of("gpuguard.p", modules["gpuguard.p"], modules).targets == {"gpuguard.p.x", "gpuguard.q"}
    assert _imports_of("gpuguard.p.x", modules["gpuguard.p.x"], modules).private_names == ["1: gpuguard.p._priv"]


def test_devtools_are_checked_too() -> None:
    names = package_modules()
    assert "devtools.devcluster" in names and "gpuguard.cli.main" in names


# --------------------------------------------------------------------------------------------- what pip installs


def test_pip_install_puts_no_dev_tooling_on_a_node(tmp_path: Path) -> None:
    """`pip install .` into a fresh venv, as `make install` does on a compute node: the product only (gpuguard and
    its metadata), no devtools/, no tests, nothing a node could import as `devtools` or `tests`."""
    wheel = _build_wheel(tmp_path / "dist")
    fresh = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = fresh / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "--disable-pip-version-check", "-q", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    (site,) = (fresh / "lib").glob("python*/site-packages")
    top_level = {p.name for p in site.iterdir()} - {"__pycache__", "_distutils_hack", "distutils-precedence.pth"}
    dist_info = {n for n in top_level if n.endswith(".dist-info")}
    assert top_level - dist_info == {"gpuguard"}, top_level
    installed = [str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()]
    assert "gpuguard/cli/main.py" in installed and (fresh / "bin" / "gpuguard").exists()
    dev_names = {path.stem for path in (REPO / DEVTOOLS).glob("*.py")} - {"__init__"}
    test_names = {path.stem for path in (REPO / "tests").rglob("*.py")} - {"__init__"}
    shipped = [n for n in installed if Path(n).stem in dev_names | test_names or "/tests/" in n]
    assert not shipped, f"dev tooling or tests installed on the node: {shipped}"
    probe = "import importlib.util as u; print(u.find_spec('devtools'), u.find_spec('tests'), u.find_spec('gpuguard'))"
    seen = subprocess.run([str(python), "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    devtools_spec, tests_spec, gpuguard_spec = seen.stdout.split(" ", 2)
    assert (devtools_spec, tests_spec) == ("None", "None") and str(site) in gpuguard_spec, seen.stdout + seen.stderr


def _build_wheel(out: Path) -> Path:
    """The wheel `pip install .` builds (PEP 517, setuptools) from a clean checkout of this tree, built without
    fetching anything: the build backend runs in this interpreter, which has setuptools and wheel (the test
    extras). A clean copy, because setuptools builds in the source tree and a stale build/lib there would ship
    modules that no longer exist."""
    checkout = out.parent / "checkout"
    for name in _checkout_files():
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(checkout)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, (
        "building the wheel failed (`make venv` installs the test extras, setuptools and wheel among them):\n"
        + build.stderr[-3000:]
    )
    (wheel,) = out.glob("gpuguard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith((f"{DEVTOOLS}/", "tests/"))], names
    return wheel


def _checkout_files() -> list[str]:
    """What a clean checkout has: the files git tracks and the new ones it does not ignore (outside git: the tree
    less what a build or a venv leaves)."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, timeout=60)
    except OSError:
        listed = None
    if listed is not None and listed.returncode == 0:
        return [n for n in listed.stdout.decode().split("\0") if n]
    left_out = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}
    return [str(p.relative_to(REPO)) for p in REPO.rglob("*")
            if p.is_file() and not left_out & set(p.relative_to(REPO).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)]


# --------------------------------------------------------------------------------------------- the report


def _report() -> None:
    for name, path in package_modules().items():
        lines = module_lines(path)
        if lines > MAX_MODULE_LINES:
            mark = " (data)" if name in DATA_MODULES else " (temporary exemption)" if name in TEMPORARY_MODULE_SIZE \
                else ""
            print(f"MODULE  {lines:5d} {name}{mark}")
        for function, length in long_functions(path):
            print(f"FUNC    {length:5d} {name}.{function}")
    graph = import_graph()
    for cycle in import_cycles({n: i.targets for n, i in graph.items()}):
        print("CYCLE  ", " <-> ".join(cycle))
    imports = package_imports(package_modules())
    for upward in upward_imports(imports, layer_of()):
        print("LAYER  ", upward)
    for cycle in package_cycles(imports):
        print("PKGCYC ", cycle)
    for name, imports in graph.items():
        for borrowed in imports.private_names:
            print(f"PRIVATE {name} <- {borrowed}")


if __name__ == "__main__":
    _report()
