"""Which physical GPU a process uses, by UUID.

Ray's GPU ids are per node, and ``CUDA_VISIBLE_DEVICES`` renumbers what a process sees (its
first visible GPU is always ``cuda:0``), so neither identifies a device across processes. The
UUID does: two processes that report the same UUID share one GPU, whatever their indices. Each
worker records the UUIDs of its visible GPUs at start (``Worker._roll_info``: ``gpu_uuids``);
weight sync matches senders and receivers by them.

Light: torch is imported only when asked, and a machine without CUDA reports no UUIDs.

A GPU's use by processes (``gpu_usage``, ``wait_released``) is read through ``nvidia-smi``
(NVML): it sees every GPU of the node whatever ``CUDA_VISIBLE_DEVICES`` says and makes no CUDA
context, so a 0-GPU task can watch a dead worker's GPU empty.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

SMI_TIMEOUT_S = 10.0
POLL_S = 0.5  # between two readings of a GPU's use (wait_released)


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


@dataclass(frozen=True)
class GpuUsage:
    free_mib: int
    pids: frozenset[int]  # the processes holding memory on it


def gpu_usage(uuids: Collection[str]) -> dict[str, GpuUsage] | None:
    """Free memory and compute processes of the GPUs ``uuids`` (``nvidia-smi``); None where it
    cannot be read (no driver tools, a GPU it does not list)."""
    want = {normalize_uuid(u) for u in uuids}
    gpus = _smi("--query-gpu=uuid,memory.free", "--format=csv,noheader,nounits")
    apps = _smi("--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader")
    if gpus is None or apps is None:
        return None
    pids: dict[str, set[int]] = {u: set() for u in want}
    for uuid, pid in _rows(apps):
        if normalize_uuid(uuid) in pids and pid.isdigit():
            pids[normalize_uuid(uuid)].add(int(pid))
    free = {normalize_uuid(u): int(f) for u, f in _rows(gpus) if f.isdigit()}
    if not want <= free.keys():
        return None
    return {u: GpuUsage(free[u], frozenset(pids[u])) for u in want}


def wait_released(
    uuids: Collection[str],
    pids: Collection[int],
    timeout_s: float,
    *,
    poll_s: float | None = None,
    read: Callable[[Collection[str]], dict[str, GpuUsage] | None] | None = None,
) -> dict:
    """Wait (bounded) until a dead worker's GPU memory is back: none of ``pids`` (its process
    and the ones it started) holds memory on the GPUs ``uuids``, and their free memory stopped
    rising (two readings ``poll_s`` apart, ``POLL_S`` by default; the driver frees a context
    after its process ended). ``read``: ``gpu_usage`` by default. Returns ``{"released":
    bool, "seconds", "free_mib"}``; ``released`` None where the GPUs cannot be read (nothing
    to wait on)."""
    poll_s = POLL_S if poll_s is None else poll_s
    read = read or gpu_usage
    start = time.monotonic()
    dead = set(pids)
    last = read(uuids)
    while last is not None:
        if time.monotonic() - start >= timeout_s:
            return _released(False, start, last)
        time.sleep(poll_s)
        now = read(uuids)
        if now is None:
            break
        held = any(dead & use.pids for use in now.values())
        rising = any(now[u].free_mib > last[u].free_mib for u in now)
        if not held and not rising:
            return _released(True, start, now)
        last = now
    return _released(None, start, None)


def _released(released: bool | None, start: float, usage: dict[str, GpuUsage] | None) -> dict:
    free = {u: use.free_mib for u, use in (usage or {}).items()}
    return {"released": released, "seconds": round(time.monotonic() - start, 2), "free_mib": free}


def _smi(*query: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", *query], capture_output=True, text=True, timeout=SMI_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _rows(text: str) -> list[tuple[str, str]]:
    rows = []
    for line in text.splitlines():
        first, _, second = line.partition(",")
        if second:
            rows.append((first.strip(), second.strip()))
    return rows
