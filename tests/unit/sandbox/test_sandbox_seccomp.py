"""The sandbox's syscall filter as built (its effect on programs: test_code_sandbox.py)."""

from __future__ import annotations

import os

import pyseccomp
import pytest

from roll_ds.sandbox import seccomp


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="every name exists on x86_64")
def test_every_denied_name_is_a_syscall_here():
    """A misspelt name would be skipped as 'not of this architecture': none is."""
    unknown = [n for n in seccomp.DENIED if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) < 0]
    assert unknown == []


def test_the_filter_is_a_bpf_program():
    program = seccomp.build_filter()
    assert program and len(program) % 8 == 0  # struct sock_filter: 8 bytes an instruction


def test_without_libseccomp_the_sandbox_refuses_naming_the_packages(monkeypatch, tmp_path):
    """No filter, no namespaces: ``required`` refuses at start (never a run without it)."""
    import sys

    from roll_ds.sandbox import Sandbox, SandboxUnavailable

    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # import fails
    with pytest.raises(seccomp.SeccompUnavailable, match=r"pyseccomp.*libseccomp2"):
        seccomp.build_filter()
    with pytest.raises(SandboxUnavailable, match=r"pyseccomp.*network_isolation: best_effort"):
        Sandbox(tmp_dir=str(tmp_path)).probe()
