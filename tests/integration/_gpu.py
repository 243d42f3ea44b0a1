"""Skip markers of the GPU tests: what a test needs beyond the ``gpu`` marker's one CUDA GPU.
The lent GPU machines have neither vLLM nor (unless carried: scripts/gpu/carry.sh) Ray, so a
test that starts an engine says so and skips there with the reason."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs; fewer are visible"
)
NEEDS_VLLM = pytest.mark.skipif(
    not installed("vllm"), reason="needs vLLM (pip install '.[gpu]'); it is not installed here"
)
