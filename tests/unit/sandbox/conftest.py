"""Fixtures of the code sandbox's tests."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from roll_ds.sandbox import Sandbox


@pytest.fixture(scope="session")
def nobody_python() -> str | None:
    """An interpreter the sandbox user can run without namespaces (the fallback runs it as that
    user when the worker is root): this one's, else the system's (e.g. when this one is under
    ``/root``, which ``nobody`` cannot enter). None when not root (nothing to choose)."""
    if os.geteuid() != 0:
        return None
    nobody = dict(user=65534, group=65534, extra_groups=[], cwd="/", capture_output=True)
    for python in (Sandbox().python, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            subprocess.run([python, "-I", "-S", "-c", "import json"], check=True, **nobody)
        except (OSError, subprocess.CalledProcessError):
            continue
        return os.path.realpath(python)
    pytest.skip("no interpreter here that the sandbox user (65534) can run")


@pytest.fixture
def shared_tmp():
    """A work-dir parent the sandbox user can enter (pytest's tmp_path is root's, mode 0700):
    where the fallback without namespaces, which runs the program in the host's files as that
    user, can make its work dirs."""
    with tempfile.TemporaryDirectory(prefix="roll_ds_test_") as path:
        os.chmod(path, 0o711)
        yield path
