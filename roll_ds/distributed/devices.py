"""Which physical GPU a process uses, by UUID.

Ray's GPU ids are per node, and ``CUDA_VISIBLE_DEVICES`` renumbers what a process sees (its
first visible GPU is always ``cuda:0``), so neither identifies a device across processes. The
UUID does: two processes that report the same UUID share one GPU, whatever their indices. Each
worker records the UUIDs of its visible GPUs at start (``Worker._roll_info``: ``gpu_uuids``);
weight sync matches senders and receivers by them.

Light: torch is imported only when asked, and a machine without CUDA reports no UUIDs.
"""

from __future__ import annotations


def normalize_uuid(uuid: object) -> str:
    """One spelling for a GPU UUID: NVML writes ``GPU-3f2a...``, torch ``3f2a...``."""
    return str(uuid).strip().lower().removeprefix("gpu-")


def device_uuid(index: int) -> str:
    """The UUID of this process's ``cuda:index``."""
    import torch

    return normalize_uuid(torch.cuda.get_device_properties(index).uuid)


def visible_gpu_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, in device-index order (empty without CUDA). Reads
    device properties only: no CUDA context (no GPU memory) is created."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    try:
        if not torch.cuda.is_available():
            return ()
        return tuple(device_uuid(i) for i in range(torch.cuda.device_count()))
    except (RuntimeError, AssertionError):  # a CPU build of torch, a broken driver
        return ()


def uuid_of(device: object) -> str | None:
    """The UUID of a torch device spec (``"cuda:1"``, ``torch.device``), None off CUDA."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda":
        return None
    return device_uuid(dev.index if dev.index is not None else torch.cuda.current_device())


def index_of_uuid(uuid: str) -> int:
    """This process's device index of the GPU ``uuid``; raises naming what it sees instead."""
    import torch

    want = normalize_uuid(uuid)
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if want in seen:
        return seen.index(want)
    raise RuntimeError(f"GPU {want} is not visible to this process (visible: {seen})")
