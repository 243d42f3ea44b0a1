"""The GPU check's ``nccl`` stage (scripts/gpu/nccl_check.py) skips cleanly without a GPU, and its
result reaches gpu_check.json (scripts/gpu/check.py report). What it shows on a GPU is in its
module doc."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roll_ds.config.compose import PROJECT_ROOT

torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is what a CPU box shows")
def test_without_a_gpu_the_stage_is_skipped_with_its_reason_and_rc_0(tmp_path: Path):
    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, "scripts/gpu/nccl_check.py", str(work)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    skipped = {"skipped": "no CUDA GPU (torch.cuda.is_available() is False)"}
    assert json.loads((work / "nccl.json").read_text()) == skipped
    out = tmp_path / "gpu_check.json"
    subprocess.run(
        [sys.executable, "scripts/gpu/check.py", "report", str(work), str(out)],
        cwd=PROJECT_ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert json.loads(out.read_text())["nccl"] == skipped
