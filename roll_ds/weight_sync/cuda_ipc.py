"""``cuda_ipc``: colocated GPU workers read rank 0's buckets straight from its GPU memory.

Same group and header protocol as ``collective`` (a gloo group carries the headers), but the
bucket bytes never travel: train rank 0 packs each bucket into one reusable GPU buffer exported
once with ``torch.multiprocessing.reductions.reduce_tensor``; the header carries the handle and
the buffer's GPU UUID; each receiver maps the buffer (once per export), copies the bucket out
into its own memory and joins a barrier, after which rank 0 reuses the buffer for the next
bucket. Receivers must see rank 0's GPU (colocated on the same device); otherwise the receive
fails naming the missing GPU. GPU only.

The worker-side ends are ``collective``'s with this module's data plane (``IpcPlane``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import Bucket, layout, pack_bucket
from roll_ds.weight_sync.collective import (
    CollectiveReceiver,
    CollectiveSender,
    CollectiveTransport,
)

if TYPE_CHECKING:
    import torch

    from roll_ds.weight_sync.group import TransferGroup


class CudaIpcTransport(CollectiveTransport):
    name = "cuda_ipc"

    def __init__(self, **kwargs: Any) -> None:
        from roll_ds.platform import current_platform

        if not current_platform().is_cuda:
            raise ValueError(
                "weight_sync.transport=cuda_ipc needs CUDA GPUs; use collective or object_store"
            )
        kwargs["backend"] = "gloo"  # control messages only; the data is shared GPU memory
        super().__init__(**kwargs)


class CudaIpcSender(CollectiveSender):
    name = "cuda_ipc"
    plane = "cuda_ipc"


class CudaIpcReceiver(CollectiveReceiver):
    name = "cuda_ipc"
    plane = "cuda_ipc"


def gpu_uuid(device_index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device_index).uuid)


def device_index_of(uuid: str) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise RuntimeError(
        f"cuda_ipc: the trainer's GPU {uuid} is not visible to this worker (visible: "
        f"{[gpu_uuid(i) for i in range(torch.cuda.device_count())]}); the roles are not "
        "colocated, use weight_sync.transport=collective"
    )


class IpcPlane:
    """The ``cuda_ipc`` data plane (``collective.DataPlane``): one exported GPU buffer."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # sender: the exported buffer
        self.handle: tuple | None = None
        self.uuid: str | None = None
        self._mapped: tuple[tuple, torch.Tensor] | None = None  # receiver: (handle, mapping)

    # rank 0 ---------------------------------------------------------------------------------

    def pack(self, bucket: Bucket, group: TransferGroup) -> tuple[Any, list, dict]:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        device = torch.device("cuda", torch.cuda.current_device())
        need = layout(bucket)[2]
        if self.buffer is None or self.buffer.numel() < need:
            self.buffer = torch.empty(need, dtype=torch.uint8, device=device)
            _, args = reduce_tensor(self.buffer)
            self.handle = tuple(args)
            self.uuid = gpu_uuid(device.index)
        packed, metas = pack_bucket(bucket, out=self.buffer)
        torch.cuda.current_stream().synchronize()  # receivers read it from another process
        return packed, metas, {"ipc": self.handle, "gpu_uuid": self.uuid}

    def push(self, buffer: torch.Tensor, group: TransferGroup, index: int) -> None:
        group.barrier(f"cuda_ipc copy of bucket {index}")  # receivers are done with the buffer

    # receivers --------------------------------------------------------------------------------

    def pull(self, header: dict, group: TransferGroup, index: int) -> torch.Tensor:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        handle = header["ipc"]
        if self._mapped is None or self._mapped[0] != handle:
            args = list(handle)
            args[6] = device_index_of(header["gpu_uuid"])  # the device index as seen here
            self._mapped = (handle, rebuild_cuda_tensor(*args))
        own = self._mapped[1][: header["nbytes"]].clone()  # rank 0 reuses its buffer
        torch.cuda.current_stream().synchronize()
        group.barrier(f"cuda_ipc copy of bucket {index}")
        return own

    def close(self) -> None:
        self.buffer = self.handle = self._mapped = None
