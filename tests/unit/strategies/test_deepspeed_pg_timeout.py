"""The trainers' process group gets ``fault_tolerance.process_group_timeout_s`` as its timeout
(``strategies._common.init_distributed``; DeepSpeed's own default, 600 s, equalled the weight
sync's bound: tests/unit/weight_sync/test_process_group_margin.py). In a process of its own, so
the default group it makes does not outlive the test."""

from __future__ import annotations

import subprocess
import sys

from roll_ds.config.compose import PROJECT_ROOT

PROBE = """
import torch
from torch.distributed import distributed_c10d
from strategies._common import init_distributed
init_distributed(42.0)
backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print("timeout_s", backend.options._timeout.total_seconds())
"""


def test_the_trainers_world_has_the_configured_timeout():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "timeout_s 42.0" in done.stdout.splitlines(), done.stdout
