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
from collections.abc import Iterable
from typing import Any, ClassVar

# What strategies expose is one of the contracts a backend implements, so it lives in
# ``roll_ds/strategy.py`` (the lower layer); re-exported here for the transports.
from roll_ds.strategy import AdapterReceiver as AdapterReceiver
from roll_ds.strategy import Bucket, WeightReceiver
from roll_ds.strategy import EngineWorkersReceiver as EngineWorkersReceiver
from roll_ds.strategy import GroupMembers as GroupMembers
from roll_ds.strategy import NamedTensors as NamedTensors
from roll_ds.strategy import Seat as Seat
from roll_ds.strategy import WeightSource as WeightSource
from roll_ds.strategy import receives_in_engine_workers as receives_in_engine_workers

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
