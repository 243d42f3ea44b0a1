"""The sandbox sits below its users: it imports the standard library and its own modules only
(and libseccomp's binding, :data:`LIBRARIES`, for its syscall filter), and the launcher (started
by file path under ``python -I -S -B``, where neither roll_ds nor site-packages is on
``sys.path``) the standard library only. Read from the source."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "roll_ds" / "sandbox"
#: third-party modules the sandbox may import, and where (seccomp.py builds the filter with it)
LIBRARIES = {"pyseccomp": "seccomp.py"}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` (any level; relative ones as ``.name``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def is_stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top == "__future__" or top in sys.stdlib_module_names


def is_own(module: str) -> bool:
    """A module of this package (``roll_ds.sandbox...`` or ``.name``, relative to it)."""
    own = module == "roll_ds.sandbox" or module.startswith("roll_ds.sandbox.")
    return own or (module.startswith(".") and not module.startswith(".."))


def test_the_sandbox_imports_the_standard_library_and_itself_only():
    files = sorted(PACKAGE.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "run.py", "launcher.py", "cgroup.py"}
    outside = [
        f"{f.name}:{line} {module}"
        for f in files
        for line, module in imports_of(f)
        if not (is_stdlib(module) or is_own(module) or LIBRARIES.get(module) == f.name)
    ]
    assert not outside, f"the sandbox imports from outside itself: {outside}"


def test_the_launcher_imports_the_standard_library_only():
    launcher = PACKAGE / "launcher.py"
    found = [f"{line} {m}" for line, m in imports_of(launcher) if not is_stdlib(m)]
    assert not found, f"launcher.py runs without roll_ds on sys.path; it imports: {found}"
