"""The two worker-side ends of a transport, and what the strategies they serve expose.

    Sender    actor_train rank 0: sends the buckets the training strategy gathered
              (``WeightSource``); ``SenderWorkerMixin`` holds one
    Receiver  every rollout worker: receives one sync into its strategy (``WeightReceiver``);
              ``ReceiverWorkerMixin`` holds one

Each transport registers one of each under its name (``SENDERS`` / ``RECEIVERS`` in
``roll_ds.weight_sync``); a worker builds its endpoint when a call first names the transport.

A rollout strategy declares what it can receive, and the receivers pick the path from that:
every one loads a full model from one iterator (``load_weights``); one that serves a LoRA adapter
alone also has ``enable_adapter_sync``; an engine whose own worker processes join the weight-sync
group (vLLM, through ``collective_rpc`` into its worker extension) sets
``receives_in_engine_workers = True`` and implements ``EngineWorkersReceiver``, so group
transports stream straight into those processes instead of through the rollout worker's.

Light: importing this module imports neither torch nor Ray.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from roll_ds.weight_sync.base import Bucket
    from roll_ds.weight_sync.group import GroupSpec

NamedTensors = Iterator[tuple[str, "torch.Tensor"]]
# One member's place in a weight-sync group: the group and its rank there. Under cuda_ipc the
# workers of one tensor-parallel engine sit in different groups (one per GPU, each rooted at the
# train rank on that GPU), so seats are per member.
Seat = tuple["GroupSpec", int]


# ---------------------------------------------------------------------------------------------
# what strategies expose


@runtime_checkable
class WeightSource(Protocol):
    """A training strategy whose weights a sync sends (actor_train)."""

    def named_weights_for_sync(self, bucket_bytes: int) -> Iterator[Bucket]:
        """Full (gathered, LoRA-merged) weights under HF names, in size-bounded buckets."""

    def adapter_buckets_for_sync(self, bucket_bytes: int) -> Iterator[Bucket]:
        """The LoRA adapter alone, under peft's names (``weight_sync.lora_sync: adapter``)."""

    def adapter_config(self) -> dict[str, Any]:
        """The policy's LoRA config as ``adapter_config.json`` content."""


@runtime_checkable
class WeightReceiver(Protocol):
    """A rollout strategy a sync can replace the served weights of."""

    def load_weights(self, named_tensors: NamedTensors) -> dict[str, Any] | None:
        """Replace the served weights with the *full* model from one iterator of HF-named
        tensors (the buckets of a sync chained); returns load stats or None."""


@runtime_checkable
class AdapterReceiver(WeightReceiver, Protocol):
    """A rollout strategy that can serve base weights + a synced LoRA adapter."""

    def enable_adapter_sync(self, config: Mapping[str, Any]) -> None:
        """From now on ``load_weights`` (and group receives) carry the adapter described by
        ``config`` (peft's ``adapter_config.json``) instead of full weights."""


class GroupMembers(Protocol):
    """The group side of a receiving strategy: the weight-sync group members it brings, joining,
    receiving one sync from the group into the served weights, leaving."""

    def transfer_group_devices(self) -> list[str | None]:
        """One entry per member it brings to a weight-sync group: the UUID of the GPU that
        member receives on (None on CPU). ``cuda_ipc`` pairs each member with the train rank on
        the same GPU by it."""

    def join_transfer_group(self, plane: str, seats: Sequence[Seat]) -> list[int]:
        """Member ``i`` joins ``seats[i]`` (leaving any previous group); returns the ranks
        taken."""

    def receive_from_group(self, plane: str) -> dict[str, Any]:
        """Every member receives one sync from the group into one reload; afterwards the new
        weights are served. Returns load stats."""

    def leave_transfer_group(self) -> None:
        """Every member leaves its group (a no-op where none was joined)."""


@runtime_checkable
class EngineWorkersReceiver(WeightReceiver, GroupMembers, Protocol):
    """An engine whose own worker processes are the group members (one per engine worker):
    group transports stream into them, not through the rollout worker's process."""

    receives_in_engine_workers: bool  # True


def receives_in_engine_workers(strategy: Any) -> bool:
    """Whether ``strategy`` declared that its engine's workers join the group themselves."""
    return bool(getattr(strategy, "receives_in_engine_workers", False))


# ---------------------------------------------------------------------------------------------
# the two ends of a transport


class Sender(ABC):
    """The trainer side of one transport: moves the buckets actor_train rank 0 gathered."""

    name: ClassVar[str]  # the transport's name

    def __init__(self, *, device: Any) -> None:
        """``device``: the sending worker's device (where a group moves GPU buffers from)."""
        self.device = device

    @abstractmethod
    def send(self, buckets: Iterable[Bucket]) -> dict[str, Any]:
        """Send one sync's buckets (already in their transfer dtype). Returns the send stats
        (``SendCounter.stats``) and whatever the driver hands the receivers (``refs``)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the sender holds (a group, a store)."""


class Receiver(ABC):
    """The rollout side of one transport: receives one sync into the worker's strategy."""

    name: ClassVar[str]  # the transport's name

    def __init__(self, strategy: WeightReceiver, *, device: Any) -> None:
        """``device``: the receiving worker's device (where an in-process member receives)."""
        self.strategy = strategy
        self.device = device

    @abstractmethod
    def receive(self, *payload: Any) -> dict[str, Any]:
        """Receive one sync (``payload``: what the sender returned for the receivers, if
        anything) into the strategy; returns its load and receive stats."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the receiver holds (a group seat)."""
