"""Start-up of a DeepSpeed rank over a build lock left by a killed build (issue 19), with
DeepSpeed's real op build: the lock is cleared and the op loads, where the start used to hang
(tests/unit/strategies/test_deepspeed_ops.py has the fast variants, the compiler stubbed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strategies.deepspeed import ops

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_startup_with_a_stale_lock_loads_the_real_op(tmp_path):
    """The same start-up with DeepSpeed's real build step: after the stale lock goes, the op is
    built (or found built: a copy of this machine's build is used when there is one) and
    loaded, and the process group comes up."""
    built = ops.extensions_root() / "deepspeed_shm_comm"
    if (built / "deepspeed_shm_comm.so").exists():  # else it is built here, from scratch
        shutil.copytree(built, tmp_path / built.name, ignore=shutil.ignore_patterns("lock"))
    lock = tmp_path / built.name / "lock"
    lock.parent.mkdir(exist_ok=True)
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # a killed build's lock
    code = "from strategies._common import init_distributed; print('RANK', init_distributed())"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert "RANK (0, 1)" in run.stdout, run.stderr[-2000:]
    assert f"removed {lock}" in run.stderr
    assert "deepspeed_shm_comm_op built successfully" in run.stdout
    assert not lock.exists()
