"""The launcher's minimal root: what of the host it binds into the sandbox."""

from __future__ import annotations

import os

from roll_ds.sandbox.launcher import interpreter_files


def test_the_sandbox_root_holds_the_interpreter_and_nothing_of_the_project():
    files = interpreter_files()
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    binds = files["binds"]

    def bound(path: str) -> bool:
        return any(path == b or path.startswith(b + "/") for b in binds)

    assert bound(files["exe"]) and bound(stdlib) and files["exe"].startswith(files["anchor"])
    repo = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    assert not [b for b in binds if bound(repo) or b.startswith(repo)]  # nor its venv
    site = os.path.join(stdlib, "site-packages")
    assert files["empty"] == ([site] if os.path.isdir(site) else [])
