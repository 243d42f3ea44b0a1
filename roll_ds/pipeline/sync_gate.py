"""The driver-side gate between generate calls made by threads playing ahead and a weight sync.

Under ``async_generation`` driver threads play episodes ahead, one generate call per turn, while
the main thread syncs weights into the same rollout engines. A Ray actor runs its calls in
order, so a turn sent while a sync is under way lands between ``pause_generation`` and
``resume_generation`` on the engine: with ``mode: stream`` a blocking call there cannot finish
(nothing can resume the stream while the actor is busy with it), and in every mode it would use
weights that are being replaced. The gate orders them instead:

- ``call()`` wraps one generate call; many run at once;
- ``sync()`` wraps a sync: new calls wait from its start (a waiting sync goes first, so the
  threads playing ahead cannot starve it), the calls already sent finish (each is one turn), then
  the sync has the engines to itself until it leaves.

A turn that arrives during a sync therefore waits for the resume and generates with the new
weights; the episode goes on across the sync.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class SyncGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls = 0  # generate calls in flight
        self._syncing = False  # a sync is waiting or running

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One generate call: waits while a sync waits or runs."""
        with self._cond:
            self._cond.wait_for(lambda: not self._syncing)
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """A weight sync: the engines to itself once the calls in flight have returned."""
        with self._cond:
            self._cond.wait_for(lambda: not self._syncing)  # one sync at a time
            self._syncing = True
            self._cond.wait_for(lambda: self._calls == 0)
        try:
            yield
        finally:
            with self._cond:
                self._syncing = False
                self._cond.notify_all()

    @property
    def calls_in_flight(self) -> int:
        with self._cond:
            return self._calls
