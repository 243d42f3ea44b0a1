"""Dispatch modes: how a call on a role fans out to its ranks and how the results come back.

    class ActorWorker(Worker):
        @register(Dispatch.DP)
        def compute_log_probs(self, batch: Batch) -> Batch: ...

    actor.compute_log_probs(batch)   # Cluster splits batch across ranks, concatenates the results

Modes:
    ALL    every rank gets the same arguments; the result is the list of per-rank results.
    DP     every ``Batch`` argument is chunked into world_size consecutive pieces (rank r gets
           piece r; sizes differ by at most one, see ``Batch.chunk``), other arguments go to every
           rank; Batch results are concatenated in rank order (so row order is kept), all-None
           results give None, anything else the per-rank list.
    RANK0  only rank 0 is called; the result is its result.

Methods without ``@register`` dispatch as ALL. Pure functions here; ``Cluster`` does the Ray calls.
Imports no torch (actors of CPU-only roles start faster without it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from roll_ds.distributed.batch import Batch

F = TypeVar("F", bound=Callable[..., Any])
ATTR = "__roll_dispatch__"


class Dispatch(enum.Enum):
    ALL = "all"
    DP = "dp"
    RANK0 = "rank0"


@dataclass(frozen=True)
class DispatchSpec:
    mode: Dispatch = Dispatch.ALL
    even: bool = False  # DP: reject batches whose length world_size does not divide


DEFAULT = DispatchSpec()


def register(mode: Dispatch = Dispatch.ALL, *, even: bool = False) -> Callable[[F], F]:
    """Record how ``Cluster`` dispatches the decorated Worker method."""
    if not isinstance(mode, Dispatch):
        raise TypeError(f"register() takes a Dispatch mode, got {mode!r}; valid: {list(Dispatch)}")

    def mark(fn: F) -> F:
        setattr(fn, ATTR, DispatchSpec(mode, even))
        return fn

    return mark


def dispatch_spec(cls: type, method: str) -> DispatchSpec:
    fn = getattr(cls, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{cls.__name__} has no method {method!r}")
    return getattr(fn, ATTR, DEFAULT)


def split_call(
    spec: DispatchSpec, world_size: int, args: tuple, kwargs: dict[str, Any]
) -> list[tuple[int, tuple, dict[str, Any]]]:
    """``(rank, args, kwargs)`` for every rank that gets called."""
    if spec.mode is Dispatch.RANK0:
        return [(0, args, kwargs)]
    if spec.mode is Dispatch.ALL:
        return [(r, args, kwargs) for r in range(world_size)]
    from roll_ds.distributed.batch import Batch  # torch only where batches are split

    pieces: dict[int | str, list[Batch]] = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, Batch):
            pieces[key] = value.chunk(world_size, even=spec.even)
    if not pieces:
        raise TypeError("a Dispatch.DP method needs at least one Batch argument to split")
    lengths = {k: sum(len(p) for p in v) for k, v in pieces.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"Dispatch.DP: Batch arguments differ in length: {lengths}")
    calls = []
    for rank in range(world_size):
        rank_args = tuple(pieces[i][rank] if i in pieces else a for i, a in enumerate(args))
        rank_kwargs = {k: pieces[k][rank] if k in pieces else v for k, v in kwargs.items()}
        calls.append((rank, rank_args, rank_kwargs))
    return calls


def collect(spec: DispatchSpec, results: list[Any]) -> Any:
    """Combine per-rank results (in rank order) as the mode says."""
    if spec.mode is Dispatch.RANK0:
        return results[0]
    if spec.mode is Dispatch.DP:
        from roll_ds.distributed.batch import Batch

        if results and all(isinstance(r, Batch) for r in results):
            return Batch.concat(results)
        if all(r is None for r in results):
            return None
    return results
