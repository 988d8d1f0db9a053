"""``sparkdl/ps/`` has no import circle: its modules' imports of each other, read from their source (those under
``typing.TYPE_CHECKING`` too), form no cycle, and the check finds one where there is."""

from __future__ import annotations

import ast
from pathlib import Path

import sparkdl.ps

PACKAGE = Path(sparkdl.ps.__file__).parent


def imports_within(package: Path, name: str) -> dict[str, set[str]]:
    """Each module of ``package`` (named ``name``) and the modules of the same package it imports."""
    modules = {f"{name}.{path.stem}": path for path in package.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                named = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            else:
                continue
            found.update(other for other in named if other in modules)
        graph[module] = found
    return graph


def a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first again at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        for other in sorted(graph[module]):
            if other in path:
                return [*path[path.index(other) :], other]
            if other not in done:
                cycle = visit(other, [*path, other])
                if cycle:
                    return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_sparkdl_ps_has_no_import_cycle():
    graph = imports_within(PACKAGE, "sparkdl.ps")
    assert len(graph) >= 10 and graph["sparkdl.ps.server"]  # it read the package's modules and their imports
    assert a_cycle(graph) is None, " -> ".join(a_cycle(graph) or [])


def test_the_check_finds_a_circle_through_a_type_checking_import(tmp_path):
    (tmp_path / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "b.py").write_text("from pkg import c\n")
    (tmp_path / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import A\n")
    assert a_cycle(imports_within(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (tmp_path / "c.py").write_text("import typing\n")
    assert a_cycle(imports_within(tmp_path, "pkg")) is None
