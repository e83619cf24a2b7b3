"""No import circle held apart by a function-level import: for every import inside a function in the project's
packages, the imported module must not reach the importing one through module-level imports (if it did, moving
the import to the top would make a circle; the function-level import only hides it).

Lazy imports that close no circle pass by construction; they are there for startup cost (server/cli.py,
server/engine_proc.py, engine/commands.py and research/commands.py load torch, the model code and the research
modules only when a command needs them) and for the research door (server/cli.py `arm_research_door` imports
research/optipipe.py only when armed). Imports under `if TYPE_CHECKING:` never run and are not edges."""
from __future__ import annotations

import ast
from pathlib import Path

from config.settings import REPO_ROOT

PACKAGES = ("engine", "grammar", "server", "research", "metrics", "config")

#: (importer, imported) pairs allowed to close a circle through a function-level import, each with its reason.
ALLOWED: set[tuple[str, str]] = set()


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every .py file of `packages` under `root`."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> set[str]:
    """The project modules an import statement in module `mod` runs (parent packages included)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            full = ".".join(base + ([node.module] if node.module else []))
        else:
            full = node.module or ""
        names = [full] + [f"{full}.{a.name}" for a in node.names]
    out = set()
    for n in names:
        parts = n.split(".")
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) in known:
                out.add(".".join(parts[:i]))
    return out


def import_edges(root: Path, packages: tuple[str, ...] = PACKAGES) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """(module-level import graph, function-level import edges) of the project modules under `root`."""
    known = _modules(root, packages)
    top: dict[str, set[str]] = {m: set() for m in known}
    lazy: set[tuple[str, str]] = set()

    def visit(mod: str, is_pkg: bool, node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(mod, is_pkg, ast.Module(body=[sub], type_ignores=[]), in_fn)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                # a module's own packages ran before it: importing them again adds no edge
                for t in {t for t in _targets(mod, is_pkg, child, known) if not (mod + ".").startswith(t + ".")}:
                    if in_fn:
                        lazy.add((mod, t))
                    else:
                        top[mod].add(t)
            visit(mod, is_pkg, child, in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for mod, f in known.items():
        visit(mod, f.name == "__init__.py", ast.parse(f.read_text(), str(f)), False)
    return top, lazy


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return False


def hidden_circles(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[tuple[str, str]]:
    """Function-level imports (importer, imported) whose target reaches the importer through module-level imports."""
    top, lazy = import_edges(root, packages)
    return sorted((a, b) for a, b in lazy if _reaches(top, b, a))


def test_no_import_circle_is_held_apart_by_a_function_level_import():
    found = set(hidden_circles(REPO_ROOT))
    assert found - ALLOWED == set(), sorted(found - ALLOWED)
    assert ALLOWED - found == set(), f"allowed circles that no longer exist (drop them): {sorted(ALLOWED - found)}"


def test_no_module_level_import_circle():
    top, _ = import_edges(REPO_ROOT)
    circles = sorted((a, b) for a in top for b in top[a] if _reaches(top, b, a))
    assert circles == [], circles


def test_the_check_finds_a_hidden_circle(tmp_path):
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import x\n")
    (pkg / "d.py").write_text("def x():\n    from engine import c\n    return c\n")
    assert hidden_circles(tmp_path, ("engine",)) == [("engine.b", "engine.a")]
