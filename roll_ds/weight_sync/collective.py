"""``collective``: a broadcast group between actor_train rank 0 (group rank 0) and every vLLM
worker (ranks 1..N), built apart from the training world.

The actors involved already have a default process group each (DeepSpeed's, vLLM's), and such
processes cannot share ``new_group``; so the group is made from its own ``TCPStore`` (hosted by
train rank 0 on a free port) + ``PrefixStore`` + a backend object: ``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU, each with ``timeout_s`` as its operation timeout.

Wire protocol, per bucket: rank 0 broadcasts a header (pickled ``TensorMeta`` list and the
buffer size: an int64 length, then the bytes), then the bucket's flat byte buffer; a ``None``
header ends the sync. Receivers turn that into one ``(name, tensor)`` iterator for vLLM's reload,
so buckets stream: rank 0 holds one packed bucket at a time, and a receiver's reload consumes
bucket k while rank 0 gathers bucket k+1. How the buffer itself travels is the *data plane*:
a broadcast here, CUDA IPC in ``cuda_ipc.py`` (same header protocol).
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import (
    Bucket,
    SendCounter,
    TransferError,
    Transport,
    pack_bucket,
    sync_metrics,
    unpack_bucket,
)

if TYPE_CHECKING:
    import torch

    from roll_ds.distributed.cluster import Cluster


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join (picklable, sent by the driver)."""

    host: str  # train rank 0's address; it hosts the TCPStore
    port: int
    world_size: int  # 1 + number of vLLM workers
    backend: str  # gloo | nccl
    timeout_s: float
    prefix: str  # store namespace, new for every connect


# ---------------------------------------------------------------------------------------------
# driver side


class CollectiveTransport(Transport):
    name = "collective"
    plane = "broadcast"

    def __init__(self, *, backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if backend is None:
            from roll_ds.platform import current_platform

            backend = current_platform().dist_backend
        self.backend = backend
        self.spec: GroupSpec | None = None

    def connect(self, train: Cluster, infer: Cluster) -> None:
        """Train rank 0 opens a store; every rollout worker reports its vLLM worker count; then
        all join at once (the group's rendezvous needs every member)."""
        deadline = time.monotonic() + self.timeout_s
        opened = train.submit("weight_sync_open", self.timeout_s)
        host, port = self._wait({train.name: opened}, deadline)[train.name]
        counts = self._wait({infer.name: infer.submit("inference_worker_count")}, deadline)
        counts = counts[infer.name]
        offsets = [1 + sum(counts[:r]) for r in range(len(counts))]
        spec = GroupSpec(
            host=host,
            port=port,
            world_size=1 + sum(counts),
            backend=self.backend,
            timeout_s=self.timeout_s,
            prefix=f"roll_ds/weight_sync/{uuid.uuid4().hex[:12]}",
        )
        self._wait(
            {
                train.name: train.submit("weight_sync_join", self.plane, spec),
                infer.name: infer.submit("weight_sync_join", self.plane, spec, offsets),
            },
            deadline,
        )
        self.spec = spec

    def sync(self, train: Cluster, infer: Cluster) -> dict[str, float]:
        if self.spec is None:
            self.connect(train, infer)
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        calls = {
            train.name: self._publish(train),
            infer.name: infer.submit("receive_weights", self.plane),
        }
        out = self._wait(calls, deadline)
        return sync_metrics(time.perf_counter() - start, out[train.name][0], out[infer.name])

    def close(self, train: Cluster, infer: Cluster) -> None:
        if self.spec is None:
            return
        self.spec = None
        deadline = time.monotonic() + self.timeout_s
        self._wait(
            {
                train.name: train.submit("weight_sync_leave"),
                infer.name: infer.submit("weight_sync_leave"),
            },
            deadline,
        )


# ---------------------------------------------------------------------------------------------
# the group (worker side)


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


# ---------------------------------------------------------------------------------------------
# data planes and the stream


class BroadcastPlane:
    """Bucket buffers go through the group itself."""

    def pack(self, bucket: Bucket, group: TransferGroup) -> tuple[Any, list, dict]:
        buffer, metas = pack_bucket(bucket, device=group.device)
        return buffer, metas, {}

    def push(self, buffer: torch.Tensor, group: TransferGroup, index: int) -> None:
        group.broadcast(buffer, f"bucket {index} ({buffer.numel()} bytes)")

    def pull(self, header: dict, group: TransferGroup, index: int) -> torch.Tensor:
        import torch

        buffer = torch.empty(header["nbytes"], dtype=torch.uint8, device=group.device)
        group.broadcast(buffer, f"bucket {index} ({header['nbytes']} bytes)")
        return buffer

    def close(self) -> None:
        pass


def make_plane(name: str) -> Any:
    if name == "broadcast":
        return BroadcastPlane()
    if name == "cuda_ipc":
        from roll_ds.weight_sync.cuda_ipc import IpcPlane

        return IpcPlane()
    raise ValueError(f"unknown weight-sync data plane {name!r}; valid: broadcast, cuda_ipc")


def send_stream(group: TransferGroup, buckets: Iterable[Bucket], plane: Any) -> dict[str, Any]:
    """Rank 0: every bucket, then the end marker. Returns send stats."""
    counter = SendCounter()
    for index, bucket in enumerate(buckets):
        start = time.perf_counter()
        buffer, metas, extra = plane.pack(bucket, group)
        group.broadcast_object(
            {"metas": metas, "nbytes": buffer.numel(), **extra}, f"header of bucket {index}"
        )
        plane.push(buffer, group, index)
        counter.add(bucket, time.perf_counter() - start)
        del buffer
    group.broadcast_object(None, "end-of-sync marker")
    return counter.stats()


class ReceiveStream:
    """A receiver's side of one sync as a ``(name, tensor)`` iterator over all buckets.

    Tensors view a fresh buffer per bucket, so a loader may keep them (vLLM's layer-wise reload
    buffers a layer's weights until the layer is complete). ``drain()`` consumes what a loader
    left unread, so a loader that failed half-way still leaves the group in step with the
    sender; after a transport failure there is nothing to drain (the group is broken)."""

    def __init__(self, group: TransferGroup, plane: Any) -> None:
        self.group, self.plane = group, plane
        self.buckets = self.bytes = 0
        self.finished = self.failed = False
        self._pending: deque[tuple[str, torch.Tensor]] = deque()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        while not self._pending:
            if self.finished or self.failed:
                raise StopIteration
            self._next_bucket()
        return self._pending.popleft()

    def _next_bucket(self) -> None:
        try:
            header = self.group.broadcast_object(None, f"header of bucket {self.buckets}")
            if header is None:
                self.finished = True
                return
            buffer = self.plane.pull(header, self.group, self.buckets)
        except BaseException:
            self.failed = True
            raise
        self.buckets += 1
        self.bytes += header["nbytes"]
        self._pending.extend(unpack_bucket(buffer, header["metas"]))

    def drain(self) -> None:
        self._pending.clear()
        while not (self.finished or self.failed):
            self._next_bucket()
            self._pending.clear()

    def stats(self) -> dict[str, Any]:
        return {"received_buckets": self.buckets, "received_bytes": self.bytes}


def receive_into(load: Any, stream: ReceiveStream) -> Any:
    """``load(stream)``; whatever the loader leaves unread (it raised half-way) is drained, so
    the sender finishes and the loader's own error is what surfaces."""
    try:
        result = load(stream)
    except BaseException:
        if not stream.failed:
            with contextlib.suppress(Exception):  # the loader's error is the one to report
                stream.drain()
        raise
    stream.drain()
    if not stream.finished:
        raise TransferError("the weight stream ended without its end-of-sync marker")
    return result
