"""Dead or stuck ranks of stateless roles replaced in place, bounded per role.

    recovery = Recovery(max_restarts=3)
    recovery.watch(rewards)                          # bring-up: initialize, as at start
    recovery.watch(engines, restore=resync_weights)  # and then the current weights
    scores = rewards.score(batch)                    # a rank that dies mid-call is replaced and
                                                     # its share of the call sent again

The retry lives here and in ``PendingCall.get`` only (``cluster.py``): every call of a watched
cluster recovers the same way, whatever phase of the step made it. What counts as dead:
a ``WorkerError`` whose cause is Ray's actor death (killed, crashed, OOM, its node gone) and a
``WorkerTimeoutError`` (a rank past its call's bound is treated as stuck for good). An exception
the method raised is not: the new rank would raise it again, so it stops the run as before.

A role's replacements over the run are bounded by ``fault_tolerance.max_restarts``; past it the
original error stops the run, with a note naming the field.

Threads: calls of one cluster may come from several threads at once (the rollout threads of
``async_generation``). One replacement runs at a time (a lock), and a rank is replaced once per
death: a call sent before another thread replaced its rank (``Cluster.incarnations`` moved on)
is only sent again. A ``restore`` may have to run on the main thread (the engines' weights come
from the trainer, which only it calls): a thread then waits for it, and the main thread, if it
waits for the lock meanwhile, runs ``idle`` (which serves that restore; ``pipeline/faults.py``).

Metrics (``pop_metrics``):
``faults/<role>/restarts`` (over the run so far, from the first replacement on) and
``faults/<role>/lost_s`` (this step's seconds from the failed call's start to its re-send).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from roll_ds.distributed.errors import WorkerError, WorkerTimeoutError

logger = logging.getLogger(__name__)

# (cluster, replaced ranks) -> None: what a new rank needs beyond Worker.__init__ and the
# role's ``initialize`` before it can take the call again (the engines: the current weights).
Restore = Callable[[Any, list[int]], None]


def is_dead(exc: BaseException) -> bool:
    """Whether ``exc`` says a rank is gone or stuck (not that a method raised)."""
    if isinstance(exc, WorkerTimeoutError):
        return exc.method != "__init__"
    if isinstance(exc, WorkerError):
        from ray.exceptions import RayActorError

        return isinstance(exc.cause, RayActorError)
    return False


def failed_ranks(exc: WorkerError | WorkerTimeoutError) -> list[int]:
    return list(exc.ranks) if isinstance(exc, WorkerTimeoutError) else [exc.rank]


@dataclass(frozen=True)
class CallBounds:
    """How long a call may take (``fault_tolerance``): ``base_s`` for any call, plus
    ``per_token_s`` per token a generate call may read or produce."""

    base_s: float
    per_token_s: float = 0.0

    def tokens(self, n: int) -> float:
        return self.base_s + self.per_token_s * max(0, n)


class Recovery:
    """Replaces dead ranks of the clusters it watches (module doc)."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {}
        self._lost_s: dict[str, float] = {}
        self._restore: dict[str, Restore | None] = {}
        self._lock = threading.RLock()  # held across a replacement and what must follow it
        # what the main thread does while it waits for another thread's replacement (module doc)
        self.idle: Callable[[], None] | None = None

    def watch(self, cluster: Any, restore: Restore | None = None) -> None:
        """Recover ``cluster``'s dead ranks from now on (``restore``: module doc)."""
        if self.max_restarts <= 0:
            return  # fault_tolerance.max_restarts: 0: today's behaviour, a dead rank stops
        self._restore[cluster.name] = restore
        cluster.recovery = self

    def handles(self, cluster: Any, exc: BaseException) -> bool:
        return cluster.name in self._restore and is_dead(exc)

    def replace(
        self,
        cluster: Any,
        exc: WorkerError | WorkerTimeoutError,
        since: float,
        sent_to: Mapping[int, int] | None = None,
        *,
        restore: bool = True,
    ) -> list[int]:
        """Replace the ranks ``exc`` names (new actors on their bundles, initialized and, with
        ``restore``, restored); returns them, to be sent their share again. Past the role's
        budget re-raises ``exc`` with a note. ``since``: when the failed call was sent
        (``time.monotonic``), for ``lost_s``. ``sent_to``: rank -> its incarnation when the
        call was sent; a rank replaced since (by another thread) is returned as it is."""
        self._acquire()
        try:
            return self._replace(cluster, exc, since, sent_to or {}, restore)
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """No other thread replaces a rank or sends a replaced rank its work meanwhile (a
        weight sync redone into a new engine, ``PolicySync``)."""
        self._acquire()
        try:
            yield
        finally:
            self._lock.release()

    def _acquire(self) -> None:
        if self.idle is None:
            self._lock.acquire()
            return
        while not self._lock.acquire(timeout=0.05):
            self.idle()  # the holder may be waiting for this thread (module doc)

    def _replace(
        self,
        cluster: Any,
        exc: WorkerError | WorkerTimeoutError,
        since: float,
        sent_to: Mapping[int, int],
        restore: bool,
    ) -> list[int]:
        role, failed = cluster.name, failed_ranks(exc)
        now = getattr(cluster, "incarnations", None)
        ranks = [r for r in failed if now is None or sent_to.get(r, now[r]) == now[r]]
        if not ranks:
            return failed  # every one replaced already, after this call was sent
        used = self.restarts.get(role, 0)
        if used + len(ranks) > self.max_restarts:
            exc.add_note(
                f"{role}: {used} of fault_tolerance.max_restarts={self.max_restarts} "
                f"replacements used; raise it to replace more"
            )
            raise exc
        logger.warning(
            "%s rank(s) %s dead or stuck (%s); replacing in place (%d of %d)",
            role,
            ranks,
            str(exc).splitlines()[0],
            used + len(ranks),
            self.max_restarts,
        )
        for rank in ranks:
            cluster.replace_rank(rank)
        if callable(getattr(cluster.worker_cls, "initialize", None)):  # as at start
            cluster.call_ranks("initialize", ranks)
        self.restarts[role] = used + len(ranks)
        restorer = self._restore.get(role)
        if restore and restorer is not None:
            restorer(cluster, ranks)
        cluster.record_shm()  # the new ranks' /dev/shm files, swept at shutdown if left
        self._lost_s[role] = self._lost_s.get(role, 0.0) + time.monotonic() - since
        return failed

    def pop_metrics(self) -> dict[str, float]:
        """``faults/<role>/restarts`` of every role replaced so far, ``faults/<role>/lost_s``
        of those replaced since the last call."""
        metrics = {f"faults/{role}/restarts": float(n) for role, n in self.restarts.items()}
        metrics.update({f"faults/{role}/lost_s": s for role, s in self._lost_s.items()})
        self._lost_s = {}
        return metrics
