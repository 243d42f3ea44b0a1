"""The core never imports the backends: no module under ``roll_ds/`` imports ``strategies``
(anywhere: module level, inside a function, under ``TYPE_CHECKING``). The core reaches a backend
only by name, through ``roll_ds.strategy.STRATEGY_SPECS``. Nor does it import ``examples`` or
``scripts`` (the embedded models' recipes live there; runs load the shipped models). Read from
the source; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "roll_ds"
BACKENDS = "strategies"
OUTSIDE = ("examples", "scripts")  # the repository's recipes and tools, not installed


def backend_imports(
    path: Path, root: Path = PACKAGE.parent, packages: tuple[str, ...] = (BACKENDS,)
) -> list[str]:
    """``module:line  statement`` for each import of ``packages`` (default: ``strategies``) in
    the file at ``path`` (``root``: the folder the dotted module name starts from)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] in packages for name in names):
            found.append(f"{module}:{node.lineno}  {ast.unparse(node)}")
    return found


def test_no_core_module_imports_strategies():
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no modules found under {PACKAGE}"
    found = [line for path in files for line in backend_imports(path)]
    assert not found, (
        "roll_ds/ must not import strategies/ (register the backend by name in "
        "roll_ds/strategy.py, or move the helper into the core):\n  " + "\n  ".join(found)
    )


def test_no_core_module_imports_examples_or_scripts():
    files = sorted(PACKAGE.rglob("*.py"))
    found = [line for path in files for line in backend_imports(path, packages=OUTSIDE)]
    assert not found, (
        "roll_ds/ must not import examples/ or scripts/ (they are not installed with the "
        "package; move what the core needs into it):\n  " + "\n  ".join(found)
    )


def test_the_check_sees_function_level_imports(tmp_path):
    source = "import os\n\n\ndef f():\n    from strategies.vllm.strategy import OWNED_KWARGS\n"
    (tmp_path / "m.py").write_text(source)
    assert backend_imports(tmp_path / "m.py", root=tmp_path) == [
        "m:5  from strategies.vllm.strategy import OWNED_KWARGS"
    ]
