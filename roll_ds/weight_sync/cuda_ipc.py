"""``cuda_ipc``: colocated GPU workers read the buckets from the train rank on their own GPU.

One group per shared GPU: the actor_train rank on it (group rank 0, the sender) and the vLLM
workers on it, paired by GPU UUID (``plan``; Ray's GPU ids are per node and
``CUDA_VISIBLE_DEVICES`` renumbers devices, so indices would pair the wrong processes). Every
train rank gathers every bucket (ZeRO-3's ``GatheredParameters`` hands each rank the full
tensors; under ZeRO 0-2 each rank holds them anyway), so each sender serves its own GPU: with
actor_train and actor_infer both on GPUs 0-15 and tensor parallel 2, train rank ``g`` sends to
the one vLLM worker on GPU ``g`` (engine ``g // 2``, TP rank ``g % 2``), and no byte leaves a GPU.

Same header protocol as ``collective`` (a gloo group carries the headers), but the bucket bytes
never travel: the sender packs each bucket into one GPU buffer per sync, exported once with
``torch.multiprocessing.reductions.reduce_tensor``; the header carries the handle and the
buffer's GPU UUID; each receiver maps the buffer (once per export), copies the bucket into its
own memory on that GPU, waits for the copy and joins a barrier, after which the sender reuses
the buffer for the next bucket. After the sync's last bucket the buffer is released on both
sides (``IpcPlane.finish``), so it holds no GPU memory between syncs. GPU only.

The worker-side ends are ``collective``'s with this module's data plane (``IpcPlane``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import Bucket, layout, pack_bucket
from roll_ds.weight_sync.collective import (
    CollectiveReceiver,
    CollectiveSender,
    CollectiveTransport,
    Plan,
)
from roll_ds.weight_sync.select import Endpoint, train_rank_by_device

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

    @staticmethod
    def plan(train: list[Endpoint], devices: list[list[str | None]]) -> Plan:
        return pair_by_gpu(train, devices)


def pair_by_gpu(train: list[Endpoint], devices: list[list[str | None]]) -> Plan:
    """Each member (``devices[rollout rank][member]``: the GPU UUID it receives on) paired with
    the lowest actor_train rank on the same GPU: ``{train rank: [(rollout rank, member), ...]}``.
    Raises naming every member whose GPU holds no train rank."""
    by_gpu = train_rank_by_device(train)
    plan: Plan = {}
    lonely = []
    for rank, members in enumerate(devices):
        for member, gpu in enumerate(members):
            if gpu is None or gpu not in by_gpu:
                lonely.append(f"actor_infer rank {rank} worker {member} (GPU {gpu})")
                continue
            plan.setdefault(by_gpu[gpu], []).append((rank, member))
    if lonely:
        raise ValueError(
            f"weight_sync.transport=cuda_ipc: {'; '.join(lonely)} share(s) no GPU with an "
            f"actor_train rank (train GPUs: {sorted(by_gpu)}); use weight_sync.transport="
            "collective for roles on separate GPUs"
        )
    return dict(sorted(plan.items()))


class CudaIpcSender(CollectiveSender):
    name = "cuda_ipc"
    plane = "cuda_ipc"


class CudaIpcReceiver(CollectiveReceiver):
    name = "cuda_ipc"
    plane = "cuda_ipc"


def gpu_uuid(device_index: int) -> str:
    from roll_ds.distributed.devices import device_uuid

    return device_uuid(device_index)


def device_index_of(uuid: str) -> int:
    from roll_ds.distributed.devices import index_of_uuid

    try:
        return index_of_uuid(uuid)
    except RuntimeError as exc:
        raise RuntimeError(
            f"cuda_ipc: the sending train rank's GPU is not visible to this worker ({exc}); the "
            "roles are not colocated, use weight_sync.transport=collective"
        ) from None


class IpcPlane:
    """The ``cuda_ipc`` data plane (``collective.DataPlane``): one exported GPU buffer per sync.

    The buffer grows to the sync's largest bucket (a 7B model's embedding alone is ~1 GB) and is
    released when the sync ends (``finish``): receivers drop their mappings, a barrier, then the
    sender drops the buffer and collects its IPC bookkeeping, so the trainer's offload and
    ``empty_cache`` can return the memory before vLLM wakes its KV cache. The next sync exports
    a fresh one. The GPU calls are the ``_allocate`` / ``_synchronize`` / ``_map`` / ``_copy`` /
    ``_collect`` hooks (a unit test runs the buffer logic on CPU through them)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # sender: the exported buffer
        self.handle: tuple | None = None
        self.uuid: str | None = None
        self._mapped: tuple[tuple, torch.Tensor] | None = None  # receiver: (handle, mapping)
        self.peak_bytes = 0  # the largest buffer this plane exported (a sync's largest bucket)

    # the sender --------------------------------------------------------------------------------

    def pack(self, bucket: Bucket, group: TransferGroup) -> tuple[Any, list, dict]:
        need = layout(bucket)[2]
        if self.buffer is None or self.buffer.numel() < need:
            self.buffer = None  # the smaller one goes before the larger one is allocated
            self.buffer, self.handle, self.uuid = self._allocate(need)
            self.peak_bytes = max(self.peak_bytes, need)
        packed, metas = pack_bucket(bucket, out=self.buffer)
        self._synchronize(self.buffer)  # receivers read it from other processes
        return packed, metas, {"ipc": self.handle, "gpu_uuid": self.uuid}

    def push(self, buffer: torch.Tensor, group: TransferGroup, index: int) -> None:
        group.barrier(f"cuda_ipc copy of bucket {index}")  # receivers are done with the buffer

    def _allocate(self, nbytes: int) -> tuple[torch.Tensor, tuple, str]:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        device = torch.device("cuda", torch.cuda.current_device())
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _, args = reduce_tensor(buffer)
        return buffer, tuple(args), gpu_uuid(device.index)

    def _synchronize(self, buffer: torch.Tensor) -> None:
        import torch

        torch.cuda.current_stream(buffer.device).synchronize()

    # receivers --------------------------------------------------------------------------------

    def pull(self, header: dict, group: TransferGroup, index: int) -> torch.Tensor:
        handle = header["ipc"]
        if self._mapped is None or self._mapped[0] != handle:
            self._mapped = None
            self._mapped = (handle, self._map(handle, header["gpu_uuid"]))
        own = self._copy(self._mapped[1], header["nbytes"])
        group.barrier(f"cuda_ipc copy of bucket {index}")
        return own

    def _map(self, handle: tuple, uuid: str) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(handle)
        args[6] = device_index_of(uuid)  # the device index as seen here
        return rebuild_cuda_tensor(*args)

    def _copy(self, mapped: torch.Tensor, nbytes: int) -> torch.Tensor:
        import torch

        # The copy runs on the mapped buffer's device (the sender's GPU, which is this worker's
        # own when colocated) and must finish before the barrier lets the sender overwrite the
        # buffer: wait on *that* device's stream, not on this process's current device's.
        with torch.cuda.device(mapped.device):
            own = mapped[:nbytes].clone()
            torch.cuda.current_stream(mapped.device).synchronize()
        return own

    # both ---------------------------------------------------------------------------------------

    def finish(self, group: TransferGroup) -> None:
        """The sync ended (every member saw the end marker): release the buffer on both sides.
        Receivers drop their mapping before the barrier, the sender its buffer after it, so no
        mapping outlives the memory it maps."""
        sender = self.buffer is not None
        self._mapped = None
        group.barrier("cuda_ipc release of the sync's buffer")
        if sender:
            self.buffer = self.handle = self.uuid = None
            self._collect()

    def _collect(self) -> None:
        import torch

        torch.cuda.ipc_collect()  # free blocks whose IPC references the receivers dropped

    def close(self) -> None:
        self.buffer = self.handle = self._mapped = None
