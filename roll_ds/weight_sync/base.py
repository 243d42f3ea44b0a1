"""What every transport shares: the driver's ``Transport`` interface, the bucket wire format (one
flat byte buffer per bucket plus a list of ``TensorMeta``), the cast to the rollout dtype, and a
bounded wait over the calls of both roles that names the worker that failed.

A sync has three sides, each transport one class per side, registered under its name
(``roll_ds.weight_sync``: ``TRANSPORTS``, ``SENDERS``, ``RECEIVERS``):

    driver       Transport: orchestrates the calls on both roles (this module's interface)
    actor_train  Sender: rank 0 sends the buckets its strategy gathers (``endpoint.py``)
    rollout      Receiver: every rollout worker receives into what its strategy can receive
                 (``endpoint.py``: ``WeightReceiver``, ``EngineWorkersReceiver``)

The workers hold their end: ``ActorTrainWorker`` / ``RolloutWorker`` inherit the Ray methods
of ``worker.py`` (``SenderWorkerMixin`` / ``ReceiverWorkerMixin``), which build the named
transport's ``Sender`` / ``Receiver`` on first use and delegate to it. Package layout:

    __init__.py      the registries (+ ``PLANES``: how a group moves bucket bytes)
    base.py          Transport, wire format, rollout dtype, bounded wait, errors
    endpoint.py      Sender / Receiver, and what strategies expose to them
    worker.py        the workers' weight-sync methods
    object_store.py  transport: Ray object store
    collective.py    transport: a broadcast group (``group.py``: the group itself); the stream
                     and ``GroupMember``, which vLLM's worker extension uses too
    cuda_ipc.py      transport: the collective's ends with a CUDA IPC data plane
    adapter.py       adapter-only LoRA sync (what the receivers write)
    wire.py          plain data for calls that cross vLLM's process boundary (collective_rpc)
    parity.py        the log-prob check after a sync
    select.py        what ``transport: auto`` means; building the configured transport

A transport is driven from the driver process:

    transport = TRANSPORTS.get(name)(bucket_bytes=..., timeout_s=..., rollout_dtype="bf16")
    transport.connect(actor_train, actor_infer)   # once: build groups (no-op for object_store)
    metrics = transport.sync(actor_train, actor_infer)   # every step: one reload per worker
    transport.close(actor_train, actor_infer)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from roll_ds.distributed.errors import ClusterError
from roll_ds.strategy import Bucket as Bucket  # a contract type: roll_ds/strategy.py defines it

if TYPE_CHECKING:
    import torch

    from roll_ds.distributed.cluster import Cluster, PendingCall

ALIGN = 16  # byte alignment of each tensor in a bucket buffer (any dtype's view stays legal)
ROLLOUT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FAILURE_GRACE_S = 2.0  # after a first failure, how long to wait for the others' errors


class WeightSyncError(ClusterError):
    """A sync failed or timed out; the message names each worker that failed and how, and
    ``failures`` holds their errors (``WorkerError``: role, rank), so a caller can tell whose
    death broke the sync (the driver restarts the run when a trainer's did)."""

    def __init__(self, message: str, failures: tuple[BaseException, ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures


class TransferError(RuntimeError):
    """A transport operation failed or timed out on this worker (raised worker-side)."""


# ---------------------------------------------------------------------------------------------
# wire format


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype without the "torch." prefix
    shape: tuple[int, ...]
    offset: int  # bytes into the bucket buffer; aliases (a tied head) share an offset
    nbytes: int


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def layout(bucket: Bucket) -> tuple[list[TensorMeta], list[torch.Tensor], int]:
    """Metas for every name of ``bucket``, the distinct tensors in buffer order, and the buffer
    size. A tensor sent under two names (the tied output embedding) is laid out once."""
    metas, unique, offsets = [], [], {}
    size = 0
    for name, tensor in bucket:
        key = id(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if key not in offsets:
            offsets[key] = size
            unique.append(tensor)
            size += -(-nbytes // ALIGN) * ALIGN
        dtype = str(tensor.dtype).removeprefix("torch.")
        metas.append(TensorMeta(name, dtype, tuple(tensor.shape), offsets[key], nbytes))
    return metas, unique, size


def pack_bucket(
    bucket: Bucket, *, device: Any = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """``bucket`` as one uint8 buffer (``out`` if given and large enough) and its metas."""
    import torch

    metas, unique, size = layout(bucket)
    if out is None or out.numel() < size:
        device = device if device is not None else (unique[0].device if unique else "cpu")
        out = torch.empty(size, dtype=torch.uint8, device=device)
    for meta, tensor in zip(_unique_metas(metas), unique, strict=True):
        out[meta.offset : meta.offset + meta.nbytes].copy_(_flat_bytes(tensor))
    return out[:size], metas


def _unique_metas(metas: list[TensorMeta]) -> list[TensorMeta]:
    seen, out = set(), []
    for m in metas:
        if m.offset not in seen:
            seen.add(m.offset)
            out.append(m)
    return out


def unpack_bucket(buffer: torch.Tensor, metas: Iterable[TensorMeta]) -> Bucket:
    """Views into ``buffer`` (no copies), one per name; aliases are the same tensor object."""
    import torch

    views: dict[int, torch.Tensor] = {}
    out = []
    for m in metas:
        if m.offset not in views:
            raw = buffer[m.offset : m.offset + m.nbytes]
            views[m.offset] = raw.view(getattr(torch, m.dtype)).view(m.shape)
        out.append((m.name, views[m.offset]))
    return out


def bucket_nbytes(bucket: Bucket) -> int:
    """Bytes of the distinct tensors of ``bucket`` (an alias counts once)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for _, t in bucket}.values())


# ---------------------------------------------------------------------------------------------
# dtype


def transfer_dtype(dtype: torch.dtype, rollout_dtype: str | None) -> torch.dtype:
    """The dtype a weight travels in: the rollout engine's when that is no wider (it would cast to
    it on load anyway, so casting first only saves bytes), else its own (an upcast on the
    receiving side is exact). Non-floating tensors keep their dtype."""
    import torch

    if rollout_dtype is None or not dtype.is_floating_point:
        return dtype
    if rollout_dtype not in ROLLOUT_DTYPES:
        raise ValueError(
            f"unknown rollout dtype {rollout_dtype!r}; valid: {', '.join(ROLLOUT_DTYPES)}"
        )
    target = getattr(torch, ROLLOUT_DTYPES[rollout_dtype])
    return target if target.itemsize <= dtype.itemsize else dtype


def cast_buckets(buckets: Iterable[Bucket], rollout_dtype: str | None) -> Iterator[Bucket]:
    """Each bucket with its tensors in ``transfer_dtype`` (aliases stay one tensor)."""
    for bucket in buckets:
        cast: dict[int, torch.Tensor] = {}
        out = []
        for name, tensor in bucket:
            if id(tensor) not in cast:
                cast[id(tensor)] = tensor.to(transfer_dtype(tensor.dtype, rollout_dtype))
            out.append((name, cast[id(tensor)]))
        yield out


class SendCounter:
    """Counts what a sender moved: buckets, names, distinct bytes, seconds in the transport."""

    def __init__(self) -> None:
        self.buckets = self.tensors = self.bytes = 0
        self.transfer_s = 0.0

    def add(self, bucket: Bucket, seconds: float) -> None:
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += bucket_nbytes(bucket)
        self.transfer_s += seconds

    def stats(self, **extra: Any) -> dict[str, Any]:
        return {
            "buckets": self.buckets,
            "num_tensors": self.tensors,
            "bytes": self.bytes,
            "transfer_seconds": self.transfer_s,
            **extra,
        }


# ---------------------------------------------------------------------------------------------
# driver side


def wait_calls(
    calls: Mapping[str, PendingCall],
    timeout_s: float,
    *,
    what: str,
    limit_s: float | None = None,
) -> dict[str, list[Any]]:
    """Wait for calls on several roles at once, bounded by ``timeout_s`` in all.

    Returns each call's per-rank results. The first failure raises ``WeightSyncError`` after a
    short grace for the other workers' errors (a dead vLLM actor and the trainer's broken
    broadcast surface together; a dead actor is listed first). No answer in time raises naming
    the roles and ranks still busy (``limit_s``: the configured limit the message quotes).
    """
    import ray

    owner = {ref: (label, i) for label, call in calls.items() for i, ref in enumerate(call.refs)}
    pending = list(owner)
    deadline = time.monotonic() + timeout_s
    failed: list[tuple[str, PendingCall]] = []
    grace_end = float("inf")
    while pending:
        now = time.monotonic()
        wait_s = max(0.0, deadline - now)
        if failed:
            wait_s = min(wait_s, max(0.0, grace_end - now))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not ready:
            break
        label, _ = owner[ready[0]]
        try:
            ray.get(ready[0])
        except Exception:
            if not failed:
                grace_end = time.monotonic() + FAILURE_GRACE_S
            if all(label != f for f, _ in failed):
                failed.append((label, calls[label]))
    late: dict[str, list[int]] = {}
    for ref in pending:
        label, i = owner[ref]
        late.setdefault(label, []).append(calls[label].ranks[i])
    busy = "; ".join(f"{label} ranks {sorted(r)}" for label, r in late.items())
    if failed:
        lines, errors = _failure_lines(failed)
        if busy:
            lines.append(f"- still busy (stuck or waiting on the failed ones): {busy}")
        raise WeightSyncError(f"{what} failed:\n" + "\n".join(lines), errors)
    if pending:
        raise WeightSyncError(
            f"{what} timed out after {limit_s or timeout_s:g} s (weight_sync.timeout_s); "
            f"still busy: {busy}"
        )
    return {label: call.get(0) for label, call in calls.items()}


def _failure_lines(
    failed: list[tuple[str, PendingCall]],
) -> tuple[list[str], tuple[BaseException, ...]]:
    """One line per failed call: its cluster's own ``WorkerError`` text (role, rank, node); and
    the errors themselves."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    lines = []
    errors = []
    for _, call in failed:
        try:
            call.get(0, recover=False)  # only its error's text: no replacement here
        except Exception as exc:  # WorkerError (or a timeout on a rank still running)
            cause = getattr(exc, "cause", None)
            died = isinstance(cause, ActorDiedError | ActorUnavailableError)
            lines.append((not died, f"- {exc}".split("\n--- original error ---")[0]))
            errors.append(exc)
    return [text for _, text in sorted(lines, key=lambda x: x[0])], tuple(errors)


def sync_metrics(
    seconds: float, sent: Mapping[str, Any], received: list[Mapping[str, Any]]
) -> dict[str, float]:
    """The ``sync/*`` metrics of one sync from rank 0's send stats and every receiver's."""
    nbytes = float(sent.get("bytes", 0))
    return {
        "sync/seconds": seconds,
        "sync/bytes": nbytes,
        "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
        "sync/num_tensors": float(sent.get("num_tensors", 0)),
        "sync/buckets": float(sent.get("buckets", 0)),
        "sync/gather_seconds": float(sent.get("gather_seconds", 0.0)),
        "sync/receive_seconds": max((float(r.get("seconds", 0.0)) for r in received), default=0.0),
        "sync/receivers": float(len(received)),
    }


class Transport(ABC):
    """Moves one sync's buckets from actor_train (rank 0, or under ``cuda_ipc`` the rank on each
    receiver's GPU) into every rollout worker."""

    name: ClassVar[str]
    senders: tuple[int, ...] = (0,)  # the actor_train ranks that send (cuda_ipc: one per GPU)

    def __init__(
        self,
        *,
        bucket_bytes: int,
        timeout_s: float,
        rollout_dtype: str | None = None,
        adapter_only: bool = False,
    ) -> None:
        """``adapter_only``: ship the LoRA adapter instead of the merged weights (the receivers
        must have been told its config; see ``roll_ds.weight_sync.adapter``)."""
        if bucket_bytes <= 0:
            raise ValueError(f"weight_sync.bucket_bytes must be > 0, got {bucket_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s must be > 0, got {timeout_s}")
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.rollout_dtype = rollout_dtype
        self.adapter_only = adapter_only

    def connect(self, train: Cluster, infer: Cluster) -> None:  # noqa: B027 - optional hook
        """Build what the transport needs between the roles (once, before the first sync)."""

    @abstractmethod
    def sync(self, train: Cluster, infer: Cluster) -> dict[str, float]:
        """One full sync; returns ``sync/*`` metrics. Raises ``WeightSyncError``."""

    def close(self, train: Cluster, infer: Cluster) -> None:  # noqa: B027 - optional hook
        """Tear down what ``connect`` built."""

    def _publish(self, train: Cluster) -> PendingCall:
        return train.submit(
            "publish_weights",
            self.name,
            self.bucket_bytes,
            rollout_dtype=self.rollout_dtype,
            adapter_only=self.adapter_only,
            senders=self.senders,
        )

    def _wait(self, calls: Mapping[str, PendingCall], deadline: float) -> dict[str, list[Any]]:
        remaining = max(0.0, deadline - time.monotonic())
        return wait_calls(
            calls, remaining, what=f"weight sync ({self.name})", limit_s=self.timeout_s
        )
