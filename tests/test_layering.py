"""The compiler/runtime boundary holds: the import arrows of docs/architecture.md ("Packages and
what they own") are the only ones the code has (tests/test_emission_service.py checks the
same at run time: training a stored plan loads none of the compiler's modules)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> package (pyproject's package-dir)
FOLDERS = {"kfac_compiler": "kfac_compiler", "passes": "kfac_compiler.passes", "runtime": "kfac_compiler.runtime",
           "models": "kfac_compiler.models"}
PACKAGES = ("backend", "blocks", "oprules", "passes", "patterns", "losses", "optimizers", "runtime", "linalg", "models")
COMPILER = {"backend", "blocks", "oprules", "passes", "patterns", "frontend"}  # the compiler's internals
CORE = {"errors", "parsing", "contract", "requests", "graph", "builder", "ir", "onnx_files", "atomic", "npz_files",
        "progress"}

# Who may import whom at module level (docs/architecture.md's table); a unit is a package of
# kfac_compiler or one of its top-level modules. The drivers (kfac_compiler/__init__, cli,
# train_cli, frontend, report, ranks, resume, locks, outputs, interrupt, config) sit above
# everything and are not listed.
ALLOWED = {
    "contract": set(),
    "errors": set(),
    "progress": set(),  # setup stages' durations to a logger: the standard library only
    "parsing": {"errors"},
    "requests": {"contract", "errors", "linalg"},
    "plan_schema": {"errors"},
    "plan": CORE | {"config", "losses", "plan_schema"},
    "host_blocks": set(),
    "linalg": {"errors", "builder"},
    "losses": {"errors", "builder"},
    "patterns": {"graph", "ir"},
    "blocks": {"errors", "builder", "ir", "linalg"},
    "oprules": {"errors", "builder", "graph"},
    "passes": CORE | {"blocks", "config", "losses", "oprules", "patterns"},
    "backend": CORE | {"blocks", "linalg", "losses", "oprules", "passes"},
    "optimizers": {"contract", "errors", "parsing", "requests", "linalg", "host_blocks"},
    "runtime": CORE | {"plan", "losses", "optimizers", "linalg", "host_blocks"},
    "models": {"losses"},
}
# Imports inside functions (on first use) that cross the boundary, each at its one place:
# module -> the units it may import lazily beyond ALLOWED
LAZY = {
    "kfac_compiler.runtime.subgraphs": {"backend"},       # the emission service: the runtime's one arrow
    "kfac_compiler.host_blocks": {"blocks"},              # the blocks' numpy twins for host-side work
    "kfac_compiler.requests": {"optimizers"},             # kind(): the optimizers register their kinds
    "kfac_compiler.oprules.check": {"passes"},            # finite-difference checks run autodiff
    "kfac_compiler.runtime.data": {"models"},             # the train command's zoo datasets
    "kfac_compiler.models.real_exports": {"torch"},       # the fixtures' dynamo exports, cleaned as the bridge's
    "kfac_compiler.plan_schema": {"config", "contract", "linalg"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("").parts
    parts = FOLDERS[rel[0]].split(".") + list(rel[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kfac_compiler" or len(parts) == 1:
        return None
    return parts[1]


def _imports(path: Path, module: str):
    """(imported module, inside a function) of every import outside `if TYPE_CHECKING:`."""
    is_package = path.name == "__init__.py"

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, in_function
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    pkg = pkg[:len(pkg) - child.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                for alias in child.names:  # `from kfac_compiler import contract`: the module named
                    yield (f"{base}.{alias.name}" if base == "kfac_compiler" else base), in_function
            yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    yield from visit(ast.parse(path.read_text()), False)


def _arrows(paths=None):
    """(module, its unit, imported unit, lazily) of every import between two units."""
    if paths is None:
        paths = [(p, _module(p)) for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    for path, module in paths:
        unit = _unit(module)
        for target, lazy in _imports(path, module):
            to = _unit(target)
            if unit is not None and to is not None and to != unit:
                yield module, unit, to, lazy


def _violations(arrows) -> list[str]:
    bad = []
    for module, unit, to, lazy in arrows:
        if unit not in ALLOWED or to in ALLOWED[unit]:
            continue
        if lazy and (to in LAZY.get(module, set()) or to == "errors"):  # errors: anywhere, on first use
            continue
        bad.append(f"{module} imports {'lazily ' if lazy else ''}kfac_compiler.{to}")
    return sorted(set(bad))


@pytest.mark.slow
def test_imports_follow_the_documented_arrows():
    bad = _violations(_arrows())
    assert not bad, "imports outside docs/architecture.md's arrows:\n" + "\n".join(bad)


@pytest.mark.slow
def test_the_runtime_side_never_names_the_compilers_internals():
    """No module of the runtime, the optimizers, the plan or the contract imports the back end,
    the blocks, the op rules, the passes or the patterns, eagerly or lazily, but at the two
    places LAZY names."""
    runtime_side = {"runtime", "optimizers", "plan", "plan_schema", "contract", "requests", "host_blocks"}
    bad = sorted({f"{m} -> {to}" for m, unit, to, lazy in _arrows()
                  if unit in runtime_side and to in COMPILER and to not in LAZY.get(m, set())})
    assert not bad


def test_the_checker_sees_a_forbidden_arrow(tmp_path):
    """The AST walk finds an eager import of the back end from a runtime module and flags it,
    skips one under TYPE_CHECKING and lets a lazy import of the contract pass."""
    src = tmp_path / "probe.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom kfac_compiler.backend import emit\n"
                   "if TYPE_CHECKING:\n    from kfac_compiler.blocks import FisherBlock\n"
                   "def f():\n    from kfac_compiler import contract\n")
    found = list(_imports(src, "kfac_compiler.runtime.probe"))
    assert found == [("typing", False), ("kfac_compiler.backend", False), ("kfac_compiler.contract", True)]
    assert _violations(_arrows([(src, "kfac_compiler.runtime.probe")])) == [
        "kfac_compiler.runtime.probe imports kfac_compiler.backend"]
