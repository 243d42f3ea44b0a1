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
    transport.close(actor_train, actor_infer)   # dead=[ranks]: an engine died (its seat with it)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from roll_ds.distributed.errors import ClusterError, WorkerError, WorkerTimeoutError
from roll_ds.strategy import Bucket as Bucket  # a contract type: roll_ds/strategy.py defines it

if TYPE_CHECKING:
    import torch

    from roll_ds.distributed.cluster import Cluster, PendingCall

ALIGN = 16  # byte alignment of each tensor in a bucket buffer (any dtype's view stays legal)
ROLLOUT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FAILURE_GRACE_S = 2.0  # after a first failure, how long to wait for the others' errors
GIB = 2**30


class WeightSyncError(ClusterError):
    """A sync failed or timed out; the message names each worker that failed and how.
    ``failures``: every worker's error (``WorkerError``: role, rank). ``causes``: those that
    say what broke the sync (``stuck_workers``): the ranks that died or raised, else a
    ``WorkerTimeoutError`` (role, ranks) for the side that stopped answering; not the ranks
    that only waited on them. A caller acts on ``causes`` (the driver restarts the run when a
    trainer's is among them; a dead or stuck engine is an engine to replace)."""

    def __init__(
        self,
        message: str,
        failures: tuple[BaseException, ...] = (),
        causes: tuple[BaseException, ...] = (),
    ) -> None:
        super().__init__(message)
        self.failures = failures
        self.causes = causes


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


def sync_nbytes(numels: Mapping[torch.dtype, int], rollout_dtype: str | None) -> int:
    """Bytes a sync moves: each dtype's elements (``WeightSource.sync_numels``) at the dtype
    they travel in (``transfer_dtype``; bucket alignment padding left out)."""
    return sum(n * transfer_dtype(d, rollout_dtype).itemsize for d, n in numels.items())


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


@dataclass(frozen=True)
class SyncBound:
    """How long one sync may take (``weight_sync``): ``timeout_s`` plus the ``nbytes`` it
    moves at ``min_gib_per_s``, the slowest throughput that is not a stuck rank. With no floor
    (None) or no bytes known (0), ``timeout_s`` alone: what connect and close wait."""

    timeout_s: float
    min_gib_per_s: float | None = None
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        if not self.min_gib_per_s or self.nbytes <= 0:
            return self.timeout_s
        return self.timeout_s + self.nbytes / (self.min_gib_per_s * GIB)

    def describe(self) -> str:
        """The bound with what it is made of, the fields named (for the timeout's message)."""
        if not self.min_gib_per_s or self.nbytes <= 0:
            return f"{self.seconds:g} s (weight_sync.timeout_s)"
        return (
            f"{self.seconds:.1f} s (weight_sync.timeout_s={self.timeout_s:g} s + "
            f"{self.nbytes} bytes ({self.nbytes / GIB:.3g} GiB) at "
            f"weight_sync.min_gib_per_s={self.min_gib_per_s:g}; raise either if the sync is "
            f"legitimately slower)"
        )


def wait_calls(
    calls: Mapping[str, PendingCall],
    timeout_s: float,
    *,
    what: str,
    limit: str | None = None,
    upstream: str | None = None,
    settle_s: float = 0.0,
) -> dict[str, list[Any]]:
    """Wait for calls on several roles at once, bounded by ``timeout_s`` in all.

    Returns each call's per-rank results. The first failure raises ``WeightSyncError`` after a
    short grace for the other workers' errors (a dead vLLM actor and the trainer's broken
    broadcast surface together; a dead actor is listed first). No answer in time raises naming
    the roles and ranks still busy (``limit``: how the message states the bound). ``upstream``:
    the role the others wait on (the trainer, who sends), for ``stuck_workers``.

    ``settle_s``: at the deadline with ranks of several roles busy and none failed, it is not
    yet known which side stopped and which waits on it (measured: an engine that stopped left
    the trainer's broadcast busy too); wait up to this much longer (a group operation's own
    timeout) for the waiting side's operation to fail and say so.
    """
    import ray

    owner = {ref: (label, i) for label, call in calls.items() for i, ref in enumerate(call.refs)}
    pending = list(owner)
    started = time.monotonic()
    deadline = started + timeout_s
    failed: list[tuple[str, PendingCall]] = []
    grace_end = float("inf")
    while pending:
        now = time.monotonic()
        wait_s = max(0.0, deadline - now)
        if failed:
            wait_s = min(wait_s, max(0.0, grace_end - now))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not ready and not failed and settle_s > 0 and len({owner[r][0] for r in pending}) > 1:
            deadline, settle_s = time.monotonic() + settle_s, 0.0  # once: who waited on whom
            continue
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
    if not (failed or pending):
        return {label: call.get(0) for label, call in calls.items()}
    late: dict[str, list[int]] = {}
    for ref in pending:
        label, i = owner[ref]
        late.setdefault(label, []).append(calls[label].ranks[i])
    late = {label: sorted(ranks) for label, ranks in late.items()}
    lines, errors = _failure_lines(failed)
    waited = time.monotonic() - started
    methods = {label: call.method for label, call in calls.items()}
    causes = stuck_workers(late, errors, methods, waited, upstream=upstream)
    stuck = [c for c in causes if isinstance(c, WorkerTimeoutError)]
    busy = "; ".join(f"{label} ranks {r}" for label, r in late.items())
    if stuck:
        named = "; ".join(f"{c.role} ranks {c.ranks}" for c in stuck)
        others = "; ".join(
            f"{label} ranks {r}" for label, r in late.items() if all(c.role != label for c in stuck)
        )
        lines.append(f"- stuck (did not answer): {named}")
        if others:
            lines.append(f"- still busy, waiting on them: {others}")
    elif busy:
        lines.append(f"- still busy (stuck or waiting on the failed ones): {busy}")
    bound = limit or f"{timeout_s:g} s"
    head = f"{what} failed:" if failed else f"{what} timed out after {bound}:"
    raise WeightSyncError("\n".join([head, *lines]), errors, causes)


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


def is_symptom(exc: BaseException) -> bool:
    """Whether ``exc`` (a rank's ``WorkerError``) is its weight-sync group operation failing or
    timing out (``TransferError``): the rank waited on a peer that died or stopped; the peer
    is the cause. vLLM's workers may hand the error back re-wrapped, so its text counts too."""
    if not isinstance(exc, WorkerError):
        return False
    from roll_ds.distributed.errors import _original

    original = _original(exc.cause)
    return isinstance(original, TransferError) or "weight-sync group rank" in str(original)


def stuck_workers(
    busy: Mapping[str, list[int]],
    errors: Iterable[BaseException],
    methods: Mapping[str, str],
    waited_s: float,
    *,
    upstream: str | None = None,
) -> tuple[BaseException, ...]:
    """What broke a sync (``WeightSyncError.causes``), from the ranks still ``busy`` (role ->
    ranks) and the ``errors`` of those that failed: the ranks that died or raised, when any
    did; else the side that stopped answering, as a ``WorkerTimeoutError`` (role, ranks).

    Which side: data flows from ``upstream`` (the trainer) to the rest, so a busy trainer rank
    is stuck unless a trainer rank's group operation failed (it waited on a receiver that did
    not take its bucket: then the busy receivers are); otherwise the busy receivers are. A
    rank whose group operation failed only waited (``is_symptom``); it is never the cause
    while another rank is. ``methods``: each role's method (for the message)."""
    errors = list(errors)
    raised = [e for e in errors if not is_symptom(e)]
    if raised:
        return tuple(raised)
    if not busy:
        return ()
    waited_on_receivers = any(isinstance(e, WorkerError) and e.role == upstream for e in errors)
    order = sorted(busy, key=lambda role: role != upstream)  # upstream first
    if waited_on_receivers and len(order) > 1:
        order = order[1:]
    role = order[0]
    return (WorkerTimeoutError(role, methods.get(role, "?"), list(busy[role]), waited_s),)


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
        min_gib_per_s: float | None = None,
    ) -> None:
        """``adapter_only``: ship the LoRA adapter instead of the merged weights (the receivers
        must have been told its config; see ``roll_ds.weight_sync.adapter``).
        ``min_gib_per_s``: a sync's bound grows by the bytes it moves at this throughput
        (``SyncBound``) once ``sync_bytes`` is set; None: ``timeout_s`` alone."""
        if bucket_bytes <= 0:
            raise ValueError(f"weight_sync.bucket_bytes must be > 0, got {bucket_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s must be > 0, got {timeout_s}")
        if min_gib_per_s is not None and min_gib_per_s <= 0:
            raise ValueError(f"weight_sync.min_gib_per_s must be > 0, got {min_gib_per_s}")
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.rollout_dtype = rollout_dtype
        self.adapter_only = adapter_only
        self.min_gib_per_s = min_gib_per_s
        self.sync_bytes = 0  # what one sync moves (build_transport asks the trainer)

    @property
    def bound(self) -> SyncBound:
        """The bound of one sync (connect and close wait ``timeout_s`` alone)."""
        return SyncBound(self.timeout_s, self.min_gib_per_s, self.sync_bytes)

    def connect(self, train: Cluster, infer: Cluster) -> None:  # noqa: B027 - optional hook
        """Build what the transport needs between the roles (once, before the first sync)."""

    @abstractmethod
    def sync(self, train: Cluster, infer: Cluster) -> dict[str, float]:
        """One full sync; returns ``sync/*`` metrics. Raises ``WeightSyncError``."""

    def close(  # noqa: B027 - optional hook
        self, train: Cluster, infer: Cluster, *, dead: Sequence[int] = ()
    ) -> None:
        """Tear down what ``connect`` built. ``dead``: rollout ranks that died (or were
        replaced since): not called, and their part is not waited for."""

    def _publish(self, train: Cluster) -> PendingCall:
        return train.submit(
            "publish_weights",
            self.name,
            self.bucket_bytes,
            rollout_dtype=self.rollout_dtype,
            adapter_only=self.adapter_only,
            senders=self.senders,
        )

    def _wait(
        self,
        calls: Mapping[str, PendingCall],
        deadline: float,
        bound: SyncBound | None = None,
        *,
        upstream: str | None = None,
    ) -> dict[str, list[Any]]:
        """``calls`` until ``deadline`` (``bound``: how the message states it; default
        ``timeout_s`` alone). ``upstream``: the trainer's name where the engines wait on what
        it sends (``stuck_workers``)."""
        bound = bound or SyncBound(self.timeout_s)
        remaining = max(0.0, deadline - time.monotonic())
        return wait_calls(
            calls,
            remaining,
            what=f"weight sync ({self.name})",
            limit=bound.describe(),
            upstream=upstream,
            settle_s=self.timeout_s,  # a group operation's own timeout (group.py)
        )

    def _sync_deadline(self) -> tuple[float, SyncBound]:
        """When one sync started now must end, and its bound."""
        bound = self.bound
        return time.monotonic() + bound.seconds, bound
