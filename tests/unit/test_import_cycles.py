"""No import cycles among ``roll_ds`` modules, read from the source (nothing is imported).

An edge ``a -> b`` is any ``import roll_ds...`` / ``from roll_ds... import`` (absolute or
relative) in module ``a``, at module level or inside a function: a function-level import only
postpones the cycle to the first call. Imports under ``if TYPE_CHECKING:`` never run and are
left out. ``from pkg import name`` points at the submodule ``pkg.name`` where one exists, else
at ``pkg`` itself.

The whole package is not clean yet (a cycle in ``roll_ds.models``: ``embedded`` <->
``embedded_rm``, and back through ``reward_model`` and ``loading``), so the test covers the
packages listed in ``CHECKED``; widen it as the others become clean.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "roll_ds"
CHECKED = ("roll_ds.distributed", "roll_ds.weight_sync")


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skipped.update(id(n) for n in ast.walk(stmt))
    return skipped


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    """The ``roll_ds`` modules ``node`` imports, as written (before resolving to a file)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "roll_ds"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    if base.split(".")[0] != "roll_ds":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the ``roll_ds`` modules it imports when run (see the module docstring)."""

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            for name in _imported(node, module, is_package, modules):
                target = resolve(name)
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    inside = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & inside))}" for m in component)


def _in_checked(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in CHECKED)


def test_no_import_cycle_touches_distributed_or_weight_sync():
    graph = import_graph(module_files())
    bad = [c for c in cycles(graph) if any(_in_checked(m) for m in c)]
    assert not bad, "import cycles: " + " | ".join(describe(c, graph) for c in bad)


def test_the_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "roll_ds"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from roll_ds.sub.c import X\n"
        "def f():\n    from .b import y\n"
    )
    (pkg / "sub" / "b.py").write_text("import roll_ds.sub.c\n")
    (pkg / "sub" / "c.py").write_text("from roll_ds.sub import a\n")
    graph = import_graph(module_files(pkg))
    assert graph["roll_ds.sub"] == {"roll_ds.sub.b"}
    assert graph["roll_ds.sub.a"] == {"roll_ds.sub.b"}  # TYPE_CHECKING left out
    assert graph["roll_ds.sub.c"] == {"roll_ds.sub.a"}
    found = cycles(graph)
    assert found == [["roll_ds.sub.a", "roll_ds.sub.b", "roll_ds.sub.c"]]
    assert "roll_ds.sub.c -> roll_ds.sub.a" in describe(found[0], graph)


@pytest.mark.parametrize("package", CHECKED)
def test_checked_packages_exist(package):
    assert package in module_files()
