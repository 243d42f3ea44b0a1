"""The weight-sync group: train rank 0 (group rank 0, the sender) and every receiver, built
apart from the training world.

The actors involved already have a default process group each (DeepSpeed's, vLLM's), and such
processes cannot share ``new_group``; so the group is made from its own ``TCPStore`` (hosted by
train rank 0 on a free port) + ``PrefixStore`` + a backend object: ``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU, each with ``timeout_s`` as its operation timeout. Every operation
raises ``TransferError`` naming this member's rank on failure or timeout. Joining is a real
rendezvous on every backend, inside the same bound: the members meet on the store (one that
never comes is named), the backend is built, NCCL's communicator initialised at once
(``eager_connect_single_device``; it would otherwise connect lazily in the first broadcast)
and a barrier passed, so a member that cannot connect fails the join, not the first sync.

NCCL and timeouts. By default torch's NCCL watchdog answers a timed-out collective by tearing the
whole process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``): a trainer or vLLM worker would die
with "Watchdog caught collective operation timeout" instead of raising. The weight-sync group is
built in blocking-wait mode instead (``TORCH_NCCL_BLOCKING_WAIT=1``, read by torch only while the
group is constructed, so the training world and vLLM's own groups keep their settings): ``wait()``
then blocks for at most ``timeout_s``, aborts this group's communicator on timeout and raises,
which becomes ``TransferError``. What the user sees: the sync fails with ``WeightSyncError``
naming the ranks that failed or were still busy, every process stays alive, and the aborted
group is left by ``Transport.close`` (``TransferGroup.close``: an abort, which never waits on a
peer); an engine that died is replaced and the group re-formed with it (``PolicySync``).

What travels over it is ``collective.py``'s stream; ``GroupMember`` there is a process's seat.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from roll_ds.strategy import GroupSpec as GroupSpec  # the contract's type; lives with it
from roll_ds.weight_sync.base import TransferError

if TYPE_CHECKING:
    import torch


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


def rendezvous(store: Any, rank: int, world_size: int, timeout: timedelta, where: str) -> None:
    """Every member announces itself on the group's store and waits (``timeout``) for all
    the others, so a member that never joins fails the join naming it; the backend is built
    only then (NCCL's communicator init waits for every peer without a bound of its own)."""
    keys = [f"joined/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except RuntimeError as exc:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TransferError(
            f"{where}: rank(s) {missing} did not join within {timeout.total_seconds():g} s "
            f"(did that member die or fail to start?): {str(exc).strip()[:200]}"
        ) from exc


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
        where = (
            f"the weight-sync group at {spec.host}:{spec.port} (rank {rank} of {spec.world_size})"
        )
        try:
            if store is None:
                store = TCPStore(spec.host, spec.port, None, False, timeout)
            prefixed = PrefixStore(spec.prefix, store)
            rendezvous(prefixed, rank, spec.world_size, timeout, where)
            self.pg = _backend(spec, prefixed, rank, self.device)
        except RuntimeError as exc:
            if isinstance(exc, TransferError):
                raise
            raise TransferError(
                f"could not join {where} within {spec.timeout_s:g} s: {exc}"
            ) from exc
        self._store = store  # keep the server (rank 0) / client alive with the group
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        """Build the communicator now, inside join's bound: NCCL would otherwise build it in the
        first broadcast (``ProcessGroupNCCL`` connects lazily), unbounded and in a sync. Then a
        barrier (bounded by ``timeout_s``): every member is connected when join returns."""
        if self.spec.backend == "nccl":
            import torch

            device = self.device
            if device.type == "cuda" and device.index is None:  # the one _backend set
                device = torch.device("cuda", torch.cuda.current_device())
            try:
                self.pg.eager_connect_single_device(device)
            except RuntimeError as exc:
                raise self._error("connecting (NCCL communicator init)", exc) from exc
        self.barrier("the join's barrier")

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
        """Leave the group without waiting on any peer: a member that died or stopped must not
        hold up the others' close (the group is re-formed with its replacement: ``PolicySync``).

        ``abort()``, not ``shutdown()``. NCCL's shutdown first finalizes the communicator
        (``ncclCommFinalize``, then waits until every NCCL kernel finished, which needs every
        peer: a dead one hangs it); its abort (``ncclCommAbort``, waited at most the group's
        timeout in torch's ``ProcessGroupNCCL::abort``) frees it without the peers.
        Nothing is lost by not flushing: every operation here is waited on before the call
        that made it returns, so none is pending at close. Gloo's abort, like its shutdown,
        closes this member's sockets at once (measured with a SIGKILLed peer); a survivor
        still waiting on this member then fails at once too, so the trainer's close frees the
        receivers of a broken sync (under NCCL they wait out their own ``timeout_s``)."""
        pg, self.pg, self._store = self.pg, None, None
        leave = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
        if callable(leave):
            with contextlib.suppress(RuntimeError):  # an aborted group may refuse twice
                leave()


# Read by ProcessGroupNCCL's constructor: wait() blocks at most the group's timeout, then aborts
# the communicator and raises (with blocking wait on, torch turns async error handling off).
NCCL_BLOCKING_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the duration, the previous values restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


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
        with scoped_env(NCCL_BLOCKING_ENV):  # a timeout raises here instead of killing us
            return dist.ProcessGroupNCCL(store, rank, spec.world_size, opts)
    raise ValueError(f"unknown weight-sync backend {spec.backend!r}; valid: gloo, nccl")
