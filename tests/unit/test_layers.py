"""Imports point one way: down the layers of ``docs/architecture.md``, never up, and never round.

Read from the source; nothing is imported. Every import the code makes counts: module level,
inside a function (it only postpones the import to the first call) and under ``if
TYPE_CHECKING:`` (the checker follows it, and it is the same dependency). The modules are every
``.py`` under ``roll_ds/`` and ``strategies/``, and ``run.py``.

An edge ``a -> b`` is ``import b`` / ``from b import x`` (absolute or relative) in ``a``;
``from pkg import name`` points at the submodule ``pkg.name`` where one exists, else at ``pkg``.
Two rules:

- no cycle: no strongly connected component of more than one module;
- no upward arrow: a module imports only modules of its own layer or of a layer below
  (``LAYERS``, lowest first; a layer's packages may import each other, acyclically).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("roll_ds", "strategies")
SCRIPTS = ("run.py",)

# Lowest first; docs/architecture.md lists the same order. A module belongs to the layer of the
# longest prefix that names it (the module or a package above it; ``roll_ds`` alone is the
# package's ``__init__``, not everything under it).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "roll_ds",
            "roll_ds.registry",
            "roll_ds.log_noise",
            "roll_ds.tracking",
            "roll_ds.checkpoint",
            "roll_ds.host",
            "roll_ds.timeline",
        ),
    ),
    ("config", ("roll_ds.config", "roll_ds.platform")),
    # export.py: a checkpoint -> an HF directory (models/weights.py); the loop calls it at each
    # save, and ``python -m roll_ds.export`` runs it
    # perf.py: model FLOPs and device peaks (the trainers report perf/tflops, perf/mfu)
    (
        "models / algorithms",
        ("roll_ds.models", "roll_ds.algorithms", "roll_ds.export", "roll_ds.perf"),
    ),
    ("strategy contracts", ("roll_ds.strategy",)),
    # the code sandbox: the code reward and the agentic python tool both run programs in it
    ("sandbox", ("roll_ds.sandbox",)),
    (
        "weight_sync / distributed / rewards / data / agentic",
        (
            "roll_ds.weight_sync",
            "roll_ds.distributed",
            "roll_ds.rewards",
            "roll_ds.data",
            "roll_ds.agentic",
            "roll_ds.threads",
        ),
    ),
    ("strategies", ("strategies",)),
    ("pipeline", ("roll_ds.pipeline",)),
    ("entry points", ("run", "roll_ds.evaluate")),
)


def module_files(root: Path = ROOT, packages=PACKAGES, scripts=SCRIPTS) -> dict[str, Path]:
    """Dotted module name -> its file (a package is its ``__init__.py``)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    for script in scripts:
        if (root / script).exists():
            out[Path(script).stem] = root / script
    return out


def _imported(
    node: ast.AST, module: str, is_package: bool, modules: dict, ours: set[str]
) -> list[str]:
    """The modules of ours (top-level names ``ours``) ``node`` imports, as written (before
    resolving to a file)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in ours]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    if base.split(".")[0] not in ours:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_edges(modules: dict[str, Path]) -> dict[tuple[str, str], set[int]]:
    """``(importer, imported)`` -> the lines where ``importer`` imports it (every kind)."""

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    # once, not per syntax node: per node it was most of the 10 s this took
    ours = {m.split(".")[0] for m in modules}
    edges: dict[tuple[str, str], set[int]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            for name in _imported(node, module, is_package, modules, ours):
                target = resolve(name)
                if target and target != module:
                    edges.setdefault((module, target), set()).add(node.lineno)
    return edges


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports (every kind)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for a, b in import_edges(modules):
        graph[a].add(b)
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


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of the longest prefix naming ``module`` (None: no layer)."""
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            names = module == prefix or (prefix != "roll_ds" and module.startswith(prefix + "."))
            if names and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    return best


def upward_arrows(edges: dict, modules: dict[str, Path]) -> list[str]:
    """``file:line  a (layer) -> b (layer)`` for each import that runs up ``LAYERS``."""
    found = []
    for (a, b), lines in sorted(edges.items()):
        la, lb = layer_of(a), layer_of(b)
        if la is not None and lb is not None and lb > la:
            where = modules[a].relative_to(ROOT) if modules[a].is_relative_to(ROOT) else modules[a]
            found.extend(
                f"{where}:{line}  {a} ({LAYERS[la][0]}) -> {b} ({LAYERS[lb][0]})"
                for line in sorted(lines)
            )
    return found


def test_every_module_has_a_layer():
    missing = [m for m in module_files() if layer_of(m) is None]
    assert not missing, (
        f"give these modules a layer in LAYERS (and docs/architecture.md): {missing}"
    )


def test_no_import_cycle():
    graph = import_graph(module_files())
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(c, graph) for c in found)


def test_no_import_runs_up_the_layers():
    modules = module_files()
    found = upward_arrows(import_edges(modules), modules)
    assert not found, (
        "imports that run up the layers (move the shared contract down, or register it by "
        "name in the lower layer):\n  " + "\n  ".join(found)
    )


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
    modules = module_files(tmp_path, packages=("roll_ds",), scripts=())
    graph = import_graph(modules)
    assert graph["roll_ds.sub"] == {"roll_ds.sub.b"}
    assert graph["roll_ds.sub.a"] == {"roll_ds.sub.b", "roll_ds.sub.c"}  # TYPE_CHECKING counts
    assert graph["roll_ds.sub.c"] == {"roll_ds.sub.a"}
    found = cycles(graph)
    assert found == [["roll_ds.sub.a", "roll_ds.sub.b", "roll_ds.sub.c"]]
    assert "roll_ds.sub.c -> roll_ds.sub.a" in describe(found[0], graph)


def test_an_upward_arrow_is_named_with_its_line(tmp_path):
    pkg = tmp_path / "roll_ds"
    (pkg / "config").mkdir(parents=True)
    (pkg / "pipeline").mkdir()
    for init in ("__init__.py", "config/__init__.py", "pipeline/__init__.py"):
        (pkg / init).write_text("")
    (pkg / "pipeline" / "p.py").write_text("X = 1\n")
    (pkg / "config" / "c.py").write_text("def f():\n    from roll_ds.pipeline.p import X\n")
    modules = module_files(tmp_path, packages=("roll_ds",), scripts=())
    found = upward_arrows(import_edges(modules), modules)
    assert len(found) == 1
    assert found[0].endswith("c.py:2  roll_ds.config.c (config) -> roll_ds.pipeline.p (pipeline)")


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_every_layer_names_modules_that_exist(layer):
    modules = module_files()
    prefixes = dict(LAYERS)[layer]
    for prefix in prefixes:
        assert any(m == prefix or m.startswith(prefix + ".") for m in modules), prefix
