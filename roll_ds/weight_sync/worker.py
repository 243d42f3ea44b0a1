"""The workers' weight-sync methods, called by the driver's ``Transport``: ``ActorTrainWorker``
inherits ``SenderWorkerMixin``, ``RolloutWorker`` inherits ``ReceiverWorkerMixin``.

A worker holds one end of a transport (``weight_sender`` / ``weight_receiver``), built from
``SENDERS`` / ``RECEIVERS`` on the first call that names the transport (a call naming another
transport closes it and builds that one's). The methods only delegate to it; what is specific to
a transport, or to a strategy, lives in the transport's ``Sender`` / ``Receiver``.

    actor_train (ActorTrainWorker)                 rollout workers (RolloutWorker)
    publish_weights(transport, ..., senders) ALL   receive_weights(transport, *payload)   ALL
    weight_sync_nbytes(dtype, adapter_only) RANK0
    adapter_config()                       RANK0   enable_adapter_sync(config)            ALL
    weight_sync_open(transport, t, senders)  ALL   weight_sync_members(transport)         ALL
    weight_sync_join(transport, specs)       ALL   weight_sync_join(transport, seats)     ALL
    weight_sync_leave()                      ALL   weight_sync_leave()                    ALL

(``open`` / ``members`` / ``join`` only for the group transports, ``collective`` and
``cuda_ipc``.) ``senders``: the train ranks that send, rank 0 alone except under ``cuda_ipc``,
where the train rank on each receiving GPU sends to the vLLM workers on that GPU; the other ranks
only join the ZeRO-3 gathers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from roll_ds.distributed.dispatch import Dispatch, register
from roll_ds.weight_sync import RECEIVERS, SENDERS
from roll_ds.weight_sync.base import Bucket, TransferError, cast_buckets, sync_nbytes
from roll_ds.weight_sync.collective import CollectiveReceiver, CollectiveSender
from roll_ds.weight_sync.endpoint import AdapterReceiver, Receiver, Seat, Sender, WeightSource

if TYPE_CHECKING:
    from roll_ds.weight_sync.group import GroupSpec


class SenderWorkerMixin:
    """actor_train's side. Every rank gathers (ZeRO-3 gathers are collective; under ZeRO 0-2
    every rank holds the full weights anyway), so any rank can send: the ``senders`` hold a
    ``Sender`` each."""

    strategy: Any  # a WeightSource; the Worker / StrategyWorker provide these
    rank: int
    local_rank: int
    weight_sender: Sender | None = None

    @register(Dispatch.ALL)
    def publish_weights(
        self,
        transport: str,
        bucket_bytes: int,
        *,
        rollout_dtype: str | None = None,
        adapter_only: bool = False,
        senders: Sequence[int] = (0,),
    ) -> dict[str, Any] | None:
        """Gather the full weights (``adapter_only``: the LoRA adapter alone) bucket by bucket
        and send them by ``transport`` from each rank in ``senders``; under ZeRO-3 the other
        ranks join every bucket's gather. Senders return their send stats (``object_store``:
        with the bucket references), the others None."""
        start = time.perf_counter()
        buckets = sync_buckets(self.strategy, bucket_bytes, adapter_only=adapter_only)
        if self.rank not in senders:
            follow_gathers(self.strategy, buckets)
            return None
        try:
            stats = self._sender(transport).send(cast_buckets(buckets, rollout_dtype))
        except TransferError:
            # The group broke (an engine died): under ZeRO-3 the other ranks are gathering the
            # rest of the buckets with this one; walk them, so no rank is left waiting in a
            # gather this one quit and the trainer can leave the group and sync again.
            follow_gathers(self.strategy, buckets)
            raise
        stats["seconds"] = time.perf_counter() - start
        stats["gather_seconds"] = stats["seconds"] - stats["transfer_seconds"]
        return stats

    @register(Dispatch.RANK0)
    def weight_sync_nbytes(self, rollout_dtype: str | None, adapter_only: bool) -> int:
        """Bytes one sync moves (``publish_weights`` with these arguments), counted without
        gathering: the driver's bound of a sync grows with them."""
        return sync_nbytes(self.strategy.sync_numels(adapter_only), rollout_dtype)

    @register(Dispatch.RANK0)
    def adapter_config(self) -> dict[str, Any]:
        """The policy's LoRA config (``weight_sync.lora_sync: adapter``)."""
        return self.strategy.adapter_config()

    @register(Dispatch.ALL)
    def weight_sync_open(
        self, transport: str, timeout_s: float, senders: Sequence[int] = (0,)
    ) -> tuple[str, int] | None:
        """A rank in ``senders`` hosts a group store for ``transport`` (leaving a previous
        group) and returns its address; the others leave any group and return None."""
        if self.rank not in senders:
            self.weight_sync_leave()
            return None
        return self._group_sender(transport).open(timeout_s)

    @register(Dispatch.ALL)
    def weight_sync_join(self, transport: str, specs: Mapping[int, GroupSpec]) -> None:
        """Join ``specs[own rank]``, the group this rank's ``weight_sync_open`` hosts, as its
        rank 0 (the sender); a rank without a group does nothing."""
        if self.rank in specs:
            self._group_sender(transport).join(specs[self.rank])

    @register(Dispatch.ALL)
    def weight_sync_leave(self) -> None:
        sender, self.weight_sender = self.weight_sender, None
        if sender is not None:
            sender.close()

    def _sender(self, transport: str) -> Sender:
        if self.weight_sender is None or self.weight_sender.name != transport:
            self.weight_sync_leave()
            self.weight_sender = SENDERS.get(transport)(device=_device(self.local_rank))
        return self.weight_sender

    def _group_sender(self, transport: str) -> CollectiveSender:
        sender = self._sender(transport)
        if not isinstance(sender, CollectiveSender):
            raise ValueError(f"weight-sync transport {transport!r} builds no group")
        return sender


class ReceiverWorkerMixin:
    """A rollout worker's side: it holds the ``Receiver``, which receives into its strategy."""

    strategy: Any  # a WeightReceiver; the Worker / StrategyWorker provide these
    rank: int
    local_rank: int
    weight_receiver: Receiver | None = None

    @register(Dispatch.ALL)
    def receive_weights(self, transport: str, *payload: Any) -> dict[str, Any]:
        """Receive one sync by ``transport`` into one reload (per vLLM worker), after which
        the new weights are served (vLLM's prefix cache dropped). ``payload``: what the sender
        returned for the receivers (``object_store``: the bucket references)."""
        start = time.perf_counter()
        stats = self._receiver(transport).receive(*payload)
        return {**stats, "seconds": time.perf_counter() - start}

    @register(Dispatch.ALL)
    def enable_adapter_sync(self, config: dict[str, Any]) -> None:
        """``weight_sync.lora_sync: adapter``: syncs from now on carry the LoRA adapter."""
        if not isinstance(self.strategy, AdapterReceiver):
            raise ValueError(
                f"weight_sync.lora_sync=adapter: the {type(self.strategy).__name__} rollout "
                "strategy cannot serve a LoRA adapter; use actor_infer strategy vllm or "
                "lora_sync=merged"
            )
        self.strategy.enable_adapter_sync(config)

    @register(Dispatch.ALL)
    def weight_sync_members(self, transport: str) -> list[str | None]:
        """The members this rank brings to ``transport``'s groups (its vLLM workers): the GPU
        UUID each receives on (None on CPU)."""
        return self._group_receiver(transport).member_devices()

    @register(Dispatch.ALL)
    def weight_sync_join(self, transport: str, seats: Sequence[Sequence[Seat]]) -> list[int]:
        """Join the groups: member ``i`` of this rank takes ``seats[rank][i]``."""
        return self._group_receiver(transport).join(list(seats[self.rank]))

    @register(Dispatch.ALL)
    def weight_sync_leave(self) -> None:
        receiver, self.weight_receiver = self.weight_receiver, None
        if receiver is not None:
            receiver.close()

    def _receiver(self, transport: str) -> Receiver:
        if self.weight_receiver is None or self.weight_receiver.name != transport:
            self.weight_sync_leave()
            cls = RECEIVERS.get(transport)
            self.weight_receiver = cls(self.strategy, device=_device(self.local_rank))
        return self.weight_receiver

    def _group_receiver(self, transport: str) -> CollectiveReceiver:
        receiver = self._receiver(transport)
        if not isinstance(receiver, CollectiveReceiver):
            raise ValueError(f"weight-sync transport {transport!r} builds no group")
        return receiver


def sync_buckets(
    strategy: WeightSource, bucket_bytes: int, *, adapter_only: bool
) -> Iterator[Bucket]:
    """What one sync sends: the LoRA adapter alone (``adapter_only``) or the full weights."""
    if adapter_only:
        return strategy.adapter_buckets_for_sync(bucket_bytes)
    return strategy.named_weights_for_sync(bucket_bytes)


def follow_gathers(strategy: WeightSource, buckets: Iterator[Bucket]) -> None:
    """A rank that does not send still must, under ZeRO-3, join every bucket's gather (a
    collective): walk the buckets."""
    if getattr(strategy, "zero_stage", 3) == 3:
        for _ in buckets:
            pass


def _device(local_rank: int) -> str:
    from roll_ds.platform import current_platform

    return current_platform().device(local_rank)
