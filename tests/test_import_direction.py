"""Dependencies inside the package point one way: no module imports a layer it may not import.

Every .py file of every package listed in pyproject.toml (the `ninfer_offload` folder, and
`kernels/`, `planner/`, `profiles/` mapped to `ninfer_offload.kernels`, `.planner`, `.profiles`) is
parsed with `ast`; every import (top level and nested inside functions, `import x` and
`from x import y`, relative ones resolved) of a `ninfer_offload` module is checked against the
table below. A failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "ninfer_offload"

# The layers, lowest first, and the layers each one may import (besides itself). A layer is the
# first component under `ninfer_offload` (`ninfer_offload.model.experts` -> "model").
#
#   errors < artifact, profiles, frontend < planner, model < kernels < convert ; runtime < serve < commands < cli
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "artifact": frozenset({"errors"}),
    "profiles": frozenset({"errors"}),
    "frontend": frozenset({"errors"}),
    "planner": frozenset({"errors", "artifact", "profiles"}),
    "model": frozenset({"errors", "artifact"}),
    "kernels": frozenset({"errors", "artifact", "model"}),  # implements the backend ops of `model`
    "convert": frozenset({"errors", "artifact", "model"}),
    "runtime": frozenset({"errors", "artifact", "profiles", "planner", "model", "kernels"}),
    "serve": frozenset({"errors", "runtime", "frontend"}),
    "commands": frozenset({"errors", "artifact", "profiles", "frontend", "planner", "model", "kernels", "convert", "runtime", "serve"}),
    "cli": frozenset({"errors", "commands"}),
    "__main__": frozenset({"cli"}),
}

# `ninfer_offload/__init__.py` is the public facade: it only holds `__version__` (importable by
# every layer) and loads its other names lazily by module path (`_LAZY`); an import of one of
# those names through the facade counts as an import of the module behind it.
FACADE = "facade"
FACADE_CONSTANTS = frozenset({"__version__"})


@dataclass(frozen=True)
class Module:
    name: str  # dotted module name, e.g. ninfer_offload.kernels.cpu.experts
    path: Path
    is_package: bool  # an __init__.py


def layer_of(module: str) -> str:
    """The layer of a `ninfer_offload` module name."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    return FACADE if len(parts) == 1 else parts[1]


def package_dirs() -> dict[str, Path]:
    """Every package listed in pyproject.toml and its folder, as setuptools maps them."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    dirs = {}
    for package in setuptools["packages"]:
        # The longest mapped prefix decides the folder; unmapped packages follow their name.
        prefix = max((p for p in mapped if package == p or package.startswith(p + ".")), key=len, default=None)
        if prefix is None:
            dirs[package] = REPO.joinpath(*package.split("."))
        else:
            dirs[package] = REPO / mapped[prefix] / Path(*package[len(prefix) :].split(".")[1:])
    return dirs


def package_modules() -> dict[str, Module]:
    modules = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            is_package = path.stem == "__init__"
            name = package if is_package else f"{package}.{path.stem}"
            modules[name] = Module(name, path, is_package)
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module name of a (possibly relative) `from ... import` statement."""
    if node.level == 0:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module: Module, tree: ast.AST, modules: dict[str, Module], lazy: dict[str, str]):
    """(line, text, target module or None for a facade constant) of every package import in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield node.lineno, f"import {alias.name}", alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                text = f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                submodule = f"{source}.{alias.name}"
                if submodule in modules:  # `from ninfer_offload.kernels.cpu import simd`
                    yield node.lineno, text, submodule
                elif source == PACKAGE and alias.name in FACADE_CONSTANTS:
                    yield node.lineno, text, None
                elif source == PACKAGE and alias.name in lazy:
                    yield node.lineno, text, lazy[alias.name]
                else:
                    yield node.lineno, text, source


def facade_lazy_names(modules: dict[str, Module]) -> dict[str, str]:
    """The facade's `_LAZY` table: public name -> module that defines it."""
    tree = ast.parse(modules[PACKAGE].path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
                return ast.literal_eval(node.value)
    return {}


def violations(modules: dict[str, Module]) -> list[str]:
    lazy = facade_lazy_names(modules)
    found = []
    for module in modules.values():
        importer = layer_of(module.name)
        if importer == FACADE:
            continue  # the public API sits on top of everything
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        for line, text, target in imported_modules(module, tree, modules, lazy):
            if target is None:
                continue
            imported = layer_of(target)
            if imported == importer:
                continue
            if imported not in ALLOWED[importer]:
                found.append(
                    f"{module.path.relative_to(REPO)}:{line}: `{text}`: layer {importer!r} may not import layer {imported!r} ({target})"
                )
    return found


def test_the_walk_sees_every_package_folder():
    modules = package_modules()
    folders = {m.path.parent.relative_to(REPO).parts[0] for m in modules.values()}
    assert {"ninfer_offload", "kernels", "planner", "profiles"} <= folders
    assert f"{PACKAGE}.kernels.backend" in modules and f"{PACKAGE}.planner.planner" in modules


def test_every_folder_with_python_files_is_a_listed_package():
    """A subpackage missing from pyproject.toml would be neither installed nor checked here."""
    listed = {folder.resolve() for folder in package_dirs().values()}
    for root in ("ninfer_offload", "kernels", "planner", "profiles"):
        for path in (REPO / root).rglob("*.py"):
            assert path.parent.resolve() in listed, (
                f"{path.parent.relative_to(REPO)} is not listed in pyproject.toml [tool.setuptools] packages"
            )


def test_every_module_belongs_to_a_layer():
    unknown = sorted({m.name for m in package_modules().values() if layer_of(m.name) not in ALLOWED and layer_of(m.name) != FACADE})
    assert not unknown, f"modules of no layer (add their layer to ALLOWED): {unknown}"


def test_imports_point_down_the_layers():
    found = violations(package_modules())
    assert not found, "imports against the layering:\n" + "\n".join(found)
