"""The weight-sync group: train rank 0 (group rank 0, the sender) and every receiver, built
apart from the training world.

The actors involved already have a default process group each (DeepSpeed's, vLLM's), and such
processes cannot share ``new_group``; so the group is made from its own ``TCPStore`` (hosted by
train rank 0 on a free port) + ``PrefixStore`` + a backend object: ``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU, each with ``timeout_s`` as its operation timeout. Every operation
raises ``TransferError`` naming this member's rank on failure or timeout.

What travels over it is ``collective.py``'s stream; ``GroupMember`` there is a process's seat.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import TransferError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join (picklable, sent by the driver)."""

    host: str  # train rank 0's address; it hosts the TCPStore
    port: int
    world_size: int  # 1 + number of receivers (one per vLLM worker)
    backend: str  # gloo | nccl
    timeout_s: float
    prefix: str  # store namespace, new for every connect


def open_store(timeout_s: float) -> tuple[Any, str, int]:
    """Train rank 0: a TCPStore server on a free port; ``(store, host, port)``."""
    from torch.distributed import TCPStore

    host = node_ip()
    store = TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, host, store.port


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return socket.gethostbyname(socket.gethostname())


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
            return sock.getsockname()[0]
        except OSError:
            return host


class TransferGroup:
    """One member of the weight-sync group; every operation raises ``TransferError`` (naming this
    rank) on failure or after ``spec.timeout_s``."""

    def __init__(self, spec: GroupSpec, rank: int, *, device: Any, store: Any = None) -> None:
        import torch
        from torch.distributed import PrefixStore, TCPStore

        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} outside the weight-sync group of {spec.world_size}")
        self.spec, self.rank = spec, rank
        # gloo moves host memory (headers, CPU buckets); NCCL the member's GPU's.
        self.device = torch.device("cpu" if spec.backend == "gloo" else device)
        timeout = timedelta(seconds=spec.timeout_s)
        try:
            if store is None:
                store = TCPStore(spec.host, spec.port, None, False, timeout)
            prefixed = PrefixStore(spec.prefix, store)
            self.pg = _backend(spec, prefixed, rank, self.device)
        except RuntimeError as exc:
            raise TransferError(
                f"could not join the weight-sync group at {spec.host}:{spec.port} as rank {rank} "
                f"of {spec.world_size} within {spec.timeout_s:g} s: {exc}"
            ) from exc
        self._store = store  # keep the server (rank 0) / client alive with the group

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Broadcast ``tensor`` from rank 0 in place."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            self.pg.broadcast([tensor], opts).wait()
        except RuntimeError as exc:
            raise self._error(what, exc) from exc

    def broadcast_object(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; ``obj`` is ignored on other ranks)."""
        import torch

        payload = pickle.dumps(obj) if self.rank == 0 else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(length, what)
        n = int(length.item())
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.broadcast(data, what)
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())

    def barrier(self, what: str) -> None:
        """Every member reached this point (an all-reduce of one element)."""
        import torch

        flag = torch.ones(1, device=self.device)
        try:
            self.pg.allreduce([flag]).wait()
        except RuntimeError as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> TransferError:
        peer = "a receiving vLLM worker" if self.rank == 0 else "train rank 0 (the sender)"
        return TransferError(
            f"weight-sync group rank {self.rank}/{self.spec.world_size}: {what} failed or timed "
            f"out (timeout {self.spec.timeout_s:g} s; did {peer} die or stop?): "
            f"{str(exc).strip()[:400]}"
        )

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(RuntimeError):
                shutdown()
        self.pg = None
        self._store = None


def _backend(spec: GroupSpec, store: Any, rank: int, device: Any) -> Any:
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.timeout_s)
    if spec.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        host = local_address_towards(spec.host)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, spec.world_size, opts)
    if spec.backend == "nccl":
        import torch

        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, spec.world_size, opts)
    raise ValueError(f"unknown weight-sync backend {spec.backend!r}; valid: gloo, nccl")
