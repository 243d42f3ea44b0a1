"""``collective``: a broadcast group between actor_train rank 0 (group rank 0) and every vLLM
worker (ranks 1..N), built apart from the training world (``group.py``: gloo on CPU, NCCL on GPU,
every operation bounded by ``timeout_s``). ``cuda_ipc`` uses the same machinery with one group per
GPU instead (``plan``): the train rank on that GPU and the vLLM workers on it.

Wire protocol, per bucket: rank 0 broadcasts a header (pickled ``TensorMeta`` list and the
buffer size: an int64 length, then the bytes), then the bucket's flat byte buffer; a ``None``
header ends the sync. Receivers turn that into one ``(name, tensor)`` iterator for vLLM's reload,
so buckets stream: rank 0 holds one packed bucket at a time, and a receiver's reload consumes
bucket k while rank 0 gathers bucket k+1. How the buffer itself travels is the *data plane*
(``PLANES``): a broadcast here, CUDA IPC in ``cuda_ipc.py`` (same header protocol).

``GroupMember`` is one process's seat in the group with its plane: the sender's, a receiver in
the rollout worker's own process, or one per vLLM worker (``strategies.vllm.worker_ext``).
``CollectiveSender`` / ``CollectiveReceiver`` are the transport's worker-side ends; the receiver
lets an engine whose workers receive themselves (``receives_in_engine_workers``) join and
receive, and otherwise seats one member in its own process that feeds ``load_weights``.

Driven by the driver (``CollectiveTransport``), the workers' calls are::

    connect  infer.weight_sync_members -> each member's GPU; the plan (which train rank sends
             to which member); train.weight_sync_open -> (host, port) per sending rank;
             train.weight_sync_join and infer.weight_sync_join together (the rendezvous)
    sync     train.publish_weights and infer.receive_weights together (the stream)
    close    train.weight_sync_leave and infer.weight_sync_leave (the ranks that died aside)

An engine that died is replaced and the group re-formed (``PolicySync``): the survivors and the
trainer leave the old group (``close`` with the dead ranks), then a new transport connects every
engine, the replacement too, on a fresh store and port.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from roll_ds.weight_sync import PLANES
from roll_ds.weight_sync.base import (
    Bucket,
    SendCounter,
    TransferError,
    Transport,
    pack_bucket,
    sync_metrics,
    unpack_bucket,
)
from roll_ds.weight_sync.endpoint import (
    GroupMembers,
    NamedTensors,
    Receiver,
    Seat,
    Sender,
    WeightReceiver,
    receives_in_engine_workers,
)
from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store
from roll_ds.weight_sync.select import Endpoint

# sender train rank -> the members it sends to, as (rollout rank, member index), in group order
Plan = dict[int, list[tuple[int, int]]]

if TYPE_CHECKING:
    import torch

    from roll_ds.distributed.cluster import Cluster


# ---------------------------------------------------------------------------------------------
# driver side


class CollectiveTransport(Transport):
    name = "collective"

    def __init__(self, *, backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if backend is None:
            from roll_ds.platform import current_platform

            backend = current_platform().dist_backend
        self.backend = backend
        self.groups: dict[int, GroupSpec] | None = None  # sender train rank -> its group

    def connect(self, train: Cluster, infer: Cluster) -> None:
        """Every rollout worker reports its members (its vLLM workers) and their GPUs; ``plan``
        says which train rank sends to which member; each sending rank opens a store; then all
        join at once (a group's rendezvous needs every member)."""
        deadline = time.monotonic() + self.timeout_s
        devices = self._wait({infer.name: infer.submit("weight_sync_members", self.name)}, deadline)
        devices = devices[infer.name]
        plan = self.plan([Endpoint.of(info) for info in train.infos], devices)
        opened = train.submit("weight_sync_open", self.name, self.timeout_s, sorted(plan))
        addresses = self._wait({train.name: opened}, deadline)[train.name]
        prefix = f"roll_ds/weight_sync/{uuid.uuid4().hex[:12]}"
        specs = {
            rank: GroupSpec(
                host=addresses[rank][0],
                port=addresses[rank][1],
                world_size=1 + len(members),
                backend=self.backend,
                timeout_s=self.timeout_s,
                prefix=f"{prefix}/{rank}",
            )
            for rank, members in plan.items()
        }
        seats = group_seats(plan, specs, [len(d) for d in devices])
        self._wait(
            {
                train.name: train.submit("weight_sync_join", self.name, specs),
                infer.name: infer.submit("weight_sync_join", self.name, seats),
            },
            deadline,
        )
        self.groups, self.senders = specs, tuple(sorted(plan))

    @staticmethod
    def plan(train: list[Endpoint], devices: list[list[str | None]]) -> Plan:
        """Train rank 0 sends to every member (``devices``: each rollout rank's members' GPUs)."""
        return {0: [(i, m) for i, members in enumerate(devices) for m in range(len(members))]}

    def sync(self, train: Cluster, infer: Cluster) -> dict[str, float]:
        if self.groups is None:
            self.connect(train, infer)
        start = time.perf_counter()
        deadline, bound = self._sync_deadline()
        calls = {
            train.name: self._publish(train),
            infer.name: infer.submit("receive_weights", self.name),
        }
        out = self._wait(calls, deadline, bound, upstream=train.name)
        sent = next(stats for stats in out[train.name] if stats is not None)
        return sync_metrics(time.perf_counter() - start, sent, out[infer.name])

    def close(self, train: Cluster, infer: Cluster, *, dead: Sequence[int] = ()) -> None:
        """Every member leaves its group (``TransferGroup.close``: never waits on a peer), the
        rollout ranks in ``dead`` aside: their seats went with their processes, and a call to
        one would only wait for its bound. A survivor of a broken sync may still be inside its
        receive, which ends when the trainer's seat closes (gloo) or at its own ``timeout_s``
        (NCCL); its leave runs after it, so with ``dead`` the wait is twice ``timeout_s``."""
        if self.groups is None:
            return
        self.groups, self.senders = None, (0,)
        deadline = time.monotonic() + (2 if dead else 1) * self.timeout_s
        calls = {train.name: train.submit("weight_sync_leave")}
        live = [rank for rank in range(infer.world_size) if rank not in dead]
        if live:
            calls[infer.name] = infer.submit("weight_sync_leave", _ranks=live)
        self._wait(calls, deadline)


def group_seats(
    plan: Plan, specs: dict[int, GroupSpec], member_counts: list[int]
) -> list[list[Seat]]:
    """Each rollout rank's seats, one per member, from ``plan`` (group rank 0 is the sender);
    raises naming a member no train rank sends to."""
    seats: list[list[Seat | None]] = [[None] * n for n in member_counts]
    for sender, members in plan.items():
        for k, (rank, member) in enumerate(members):
            seats[rank][member] = (specs[sender], 1 + k)
    missing = [(r, m) for r, row in enumerate(seats) for m, seat in enumerate(row) if seat is None]
    if missing:
        raise ValueError(f"weight sync: no train rank sends to (rollout rank, member) {missing}")
    return seats  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# data planes and the stream


class DataPlane(Protocol):
    """How a bucket's buffer travels once its header went through the group."""

    def pack(self, bucket: Bucket, group: TransferGroup) -> tuple[Any, list, dict]:
        """Rank 0: ``(buffer, metas, extra header fields)`` of ``bucket``."""

    def push(self, buffer: torch.Tensor, group: TransferGroup, index: int) -> None:
        """Rank 0: deliver the packed buffer (or wait until the receivers copied it)."""

    def pull(self, header: dict, group: TransferGroup, index: int) -> torch.Tensor:
        """A receiver: this process's copy of the buffer the header announced."""

    def finish(self, group: TransferGroup) -> None:
        """Every member, after the end-of-sync marker: release what the sync held."""

    def close(self) -> None:
        """Drop buffers and mappings."""


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

    def finish(self, group: TransferGroup) -> None:
        pass  # a fresh buffer per bucket: nothing outlives it

    def close(self) -> None:
        pass


def send_stream(
    group: TransferGroup, buckets: Iterable[Bucket], plane: DataPlane
) -> dict[str, Any]:
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
    plane.finish(group)
    return counter.stats()


class ReceiveStream:
    """A receiver's side of one sync as a ``(name, tensor)`` iterator over all buckets.

    Tensors view a fresh buffer per bucket, so a loader may keep them (vLLM's layer-wise reload
    buffers a layer's weights until the layer is complete). ``drain()`` consumes what a loader
    left unread, so a loader that failed half-way still leaves the group in step with the
    sender; after a transport failure there is nothing to drain (the group is broken)."""

    def __init__(self, group: TransferGroup, plane: DataPlane) -> None:
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
                self.plane.finish(self.group)
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


def receive_into(load: Callable[[ReceiveStream], Any], stream: ReceiveStream) -> Any:
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


# ---------------------------------------------------------------------------------------------
# a process's seat in the group


class GroupMember:
    """This process's seat in (at most) one weight-sync group, with the data plane its bucket
    buffers travel by. Joining leaves the previous group first; every operation checks that
    the seat was joined by the plane asked for."""

    def __init__(self) -> None:
        self.group: TransferGroup | None = None
        self.plane: DataPlane | None = None
        self.plane_name: str | None = None

    def join(
        self, spec: GroupSpec, rank: int, plane: str, *, device: Any, store: Any = None
    ) -> None:
        """Join as ``rank`` (blocks until every member joins, bounded by ``spec.timeout_s``)."""
        self.leave()
        data_plane = PLANES.get(plane)()
        self.group = TransferGroup(spec, rank, device=device, store=store)
        self.plane, self.plane_name = data_plane, plane

    def send(self, buckets: Iterable[Bucket], plane: str) -> dict[str, Any]:
        """Rank 0: stream one sync; returns send stats."""
        return send_stream(self._joined("send", plane), buckets, self.plane)

    def receive(self, load: Callable[[NamedTensors], Any], plane: str) -> dict[str, Any]:
        """``load`` one sync from the stream; its stats plus the stream's."""
        stream = ReceiveStream(self._joined("receive", plane), self.plane)
        return {**(receive_into(load, stream) or {}), **stream.stats()}

    def leave(self) -> None:
        group, plane = self.group, self.plane
        self.group = self.plane = self.plane_name = None
        if plane is not None:
            plane.close()
        if group is not None:
            group.close()

    def _joined(self, what: str, plane: str) -> TransferGroup:
        if self.group is None:
            raise RuntimeError(
                f"weight sync: asked to {what} by {plane!r}, but this worker has joined no "
                "weight-sync group (the transport's connect() builds it)"
            )
        if plane != self.plane_name:
            raise RuntimeError(
                f"weight sync: asked to {what} by {plane!r}; the group was joined by "
                f"{self.plane_name!r}"
            )
        return self.group


# ---------------------------------------------------------------------------------------------
# worker side


class CollectiveSender(Sender):
    """actor_train rank 0: hosts the group's store, joins as rank 0, streams every sync."""

    name = "collective"
    plane: ClassVar[str] = "broadcast"

    def __init__(self, *, device: Any) -> None:
        super().__init__(device=device)
        self.member = GroupMember()
        self._store: Any = None

    def open(self, timeout_s: float) -> tuple[str, int]:
        """Host the group's store (leaving a previous group); returns its ``(host, port)``."""
        self.close()
        self._store, host, port = open_store(timeout_s)
        return host, port

    def join(self, spec: GroupSpec) -> None:
        """Join the group ``open`` hosts as its rank 0."""
        if self._store is None:
            raise RuntimeError("weight_sync_join before weight_sync_open")
        self.member.join(spec, 0, self.plane, device=self.device, store=self._store)

    def send(self, buckets: Iterable[Bucket]) -> dict[str, Any]:
        return self.member.send(buckets, self.plane)

    def close(self) -> None:
        self.member.leave()
        self._store = None


class CollectiveReceiver(Receiver):
    """A rollout worker's end: its strategy's engine workers join and receive themselves when
    it declares ``receives_in_engine_workers``; otherwise one member in this process streams
    each sync into ``load_weights``."""

    name = "collective"
    plane: ClassVar[str] = "broadcast"

    def __init__(self, strategy: WeightReceiver, *, device: Any) -> None:
        super().__init__(strategy, device=device)
        in_engine = receives_in_engine_workers(strategy)  # then an EngineWorkersReceiver
        self.members: GroupMembers = strategy if in_engine else InProcessMember(strategy, device)

    def member_devices(self) -> list[str | None]:
        """The GPU (UUID; None on CPU) of each member this worker brings to the group."""
        return self.members.transfer_group_devices()

    def join(self, seats: list[Seat]) -> list[int]:
        """Member ``i`` joins ``seats[i]``; returns the ranks taken."""
        return self.members.join_transfer_group(self.plane, seats)

    def receive(self) -> dict[str, Any]:
        return self.members.receive_from_group(self.plane)

    def close(self) -> None:
        self.members.leave_transfer_group()


class InProcessMember:
    """The group side of a strategy that receives in the rollout worker's own process (any
    ``WeightReceiver``): one member feeding ``load_weights``. It is ``GroupMembers`` like an
    ``EngineWorkersReceiver``, so ``CollectiveReceiver`` drives both alike."""

    def __init__(self, strategy: WeightReceiver, device: Any) -> None:
        self.strategy, self.device = strategy, device
        self.member = GroupMember()

    def transfer_group_devices(self) -> list[str | None]:
        from roll_ds.distributed.devices import uuid_of

        return [uuid_of(self.device)]

    def join_transfer_group(self, plane: str, seats: list[Seat]) -> list[int]:
        ((spec, rank),) = seats
        self.member.join(spec, rank, plane, device=self.device)
        return [rank]

    def receive_from_group(self, plane: str) -> dict[str, Any]:
        return self.member.receive(self.strategy.load_weights, plane)

    def leave_transfer_group(self) -> None:
        self.member.leave()
