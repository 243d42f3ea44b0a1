"""``object_store``: buckets through Ray's object store.

actor_train rank 0 puts each gathered bucket (as raw byte arrays, so a reader on the same node
maps them zero-copy from shared memory) and returns the references; every rollout worker then
reads them bucket by bucket into one reload. Rank 0's own memory holds one bucket at a time; the
object store holds the whole model until the receivers are done (the driver then drops the
references). Works across nodes (Ray moves the objects) and with any rollout strategy that has
``load_weights``.

The workers' calls: ``train.publish_weights`` (``ObjectStoreSender`` returns the references),
then ``infer.receive_weights("object_store", refs)`` (``ObjectStoreReceiver`` reads them).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import (
    Bucket,
    SendCounter,
    TensorMeta,
    Transport,
    _flat_bytes,
    _unique_metas,
    layout,
    sync_metrics,
)
from roll_ds.weight_sync.endpoint import NamedTensors, Receiver, Sender

if TYPE_CHECKING:
    import torch

    from roll_ds.distributed.cluster import Cluster


class ObjectStoreTransport(Transport):
    name = "object_store"

    def sync(self, train: Cluster, infer: Cluster) -> dict[str, float]:
        start = time.perf_counter()
        deadline, bound = self._sync_deadline()
        sent = self._wait({train.name: self._publish(train)}, deadline, bound)[train.name][0]
        load = infer.submit("receive_weights", self.name, sent["refs"])
        received = self._wait({infer.name: load}, deadline, bound)[infer.name]
        return sync_metrics(time.perf_counter() - start, sent, received)


# ---------------------------------------------------------------------------------------------
# worker side


class ObjectStoreSender(Sender):
    """actor_train rank 0: puts every bucket; the stats carry their ``refs``."""

    name = "object_store"

    def send(self, buckets: Iterable[Bucket]) -> dict[str, Any]:
        return put_buckets(buckets)


class ObjectStoreReceiver(Receiver):
    """A rollout worker: reads the buckets behind ``refs`` into one ``load_weights``."""

    name = "object_store"

    def receive(self, refs: list[Any]) -> dict[str, Any]:
        return self.strategy.load_weights(iter_refs(refs)) or {}


def put_buckets(buckets: Iterable[Bucket]) -> dict[str, Any]:
    """Rank 0: put every bucket in the object store; ``refs`` plus send stats."""
    import ray

    counter = SendCounter()
    refs = []
    for bucket in buckets:
        start = time.perf_counter()
        metas, unique, _ = layout(bucket)
        arrays = [_flat_bytes(t).cpu().numpy() for t in unique]
        refs.append(ray.put((metas, arrays)))
        counter.add(bucket, time.perf_counter() - start)
    return counter.stats(refs=refs)


def decode_bucket(metas: list[TensorMeta], arrays: list[Any]) -> Bucket:
    """Tensors viewing the arrays (zero-copy; read-only shared memory for a local object)."""
    import torch

    by_offset = dict(zip((m.offset for m in _unique_metas(metas)), arrays, strict=True))
    views: dict[int, torch.Tensor] = {}
    out = []
    with warnings.catch_warnings():  # the arrays are read-only; the loader only reads them
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for m in metas:
            if m.offset not in views:
                raw = torch.from_numpy(by_offset[m.offset])
                views[m.offset] = raw.view(getattr(torch, m.dtype)).view(m.shape)
            out.append((m.name, views[m.offset]))
    return out


def iter_refs(refs: list[Any]) -> NamedTensors:
    """The named tensors of every bucket, each bucket fetched when the loader reaches it."""
    import ray

    for ref in refs:
        metas, arrays = ray.get(ref)
        yield from decode_bucket(metas, arrays)
