"""Which of the run's roles are replaced in place when a rank dies or hangs, and how a new rank
is brought up (``roll_ds/distributed/recovery.py`` does the replacing, inside every call).

Replaced (``fault_tolerance.max_restarts`` each over the run): the reward roles (``rewards.*``:
rule functions, reward models, judges; ``initialize`` rebuilds their scorer), the reference
(its weights are the pretrained ones: ``initialize`` loads them again) and the rollout engines
(``actor_infer``: ``initialize``, then a full weight sync of the trainer's current weights into
every engine with the parity check, ``PolicySync.restore_engines``), in the synchronous loop
and under ``async_generation`` alike:

- the work a dead engine had is sent again to its replacement: its share of a generate call
  (``mode: batch``), or (``mode: stream``) its share of each streamed batch it had not returned
  (``RolloutEngines``: submitted again, then collected). Requests are seeded by their row, so
  the prompts, their order and their seeds are the run's whatever the engine that plays them;
  under ``async_generation`` the replayed share samples with the trainer's weights at the
  time of the replacement, which may be newer than the rest of its step's.
- an engine that dies inside a weight sync is replaced and the sync done again, in full, into
  every engine (``PolicySync``).
- under a group transport (``collective``, ``cuda_ipc``) the dead engine held a seat in the
  trainer's group: every replacement re-forms it. The trainer and the surviving engines leave
  the old group without calling the dead (``Transport.close(dead=...)``; each member's close
  is an abort, which never waits on a peer), and a new transport seats every engine, the new
  one too, on a fresh store before the sync (``PolicySync._drop_transport``).
- the restore is a weight sync from the trainer, which only the main thread calls: a rollout
  thread that replaced an engine waits for it (``MainThreadRestore``), and the main thread
  serves it wherever it waits for the rollout threads (``RolloutQueue``) or for the
  replacement itself.

Not replaced, and why:
- actor_train and critic: their optimizer state and ZeRO shards are the run (the driver
  restarts the run from its latest checkpoint: ``pipeline/restarts.py``).
- roles the colocation choreography manages (they take turns on GPUs with the trainers; a new
  rank would have to join that dance in the middle of a phase).
- a role of several DeepSpeed ranks (a reference or reward model on ``deepspeed_*``): its ranks
  share a process group at start, which a new rank cannot join alone.
Environment hosts (``roll_ds/agentic/env_pool.py``) are not a cluster: their pool replaces a
dead or stuck host itself (``fault_tolerance.max_restarts`` over the run), and the runner plays
every episode the host held again from its start with the same seeds
(``roll_ds/agentic/runner.py``); ``faults/env_hosts/*`` come from the pool.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from roll_ds.config.fault_tolerance import is_stateless
from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.recovery import CallBounds, Recovery, Restore
from roll_ds.pipeline.colocation.choreography import Choreography


def call_bounds(cfg: RLVRConfig) -> CallBounds:
    ft = cfg.fault_tolerance
    return CallBounds(base_s=ft.call_timeout_s, per_token_s=ft.per_token_s)


def watch_stateless(
    cfg: RLVRConfig,
    clusters: Mapping[str, Any],
    colocation: Choreography,
    restore_engines: Restore,
) -> Recovery:
    """A ``Recovery`` watching every role this run can replace (module doc); replaced engines
    are brought up by ``restore_engines``."""
    recovery = Recovery(cfg.fault_tolerance.max_restarts)
    plan = colocation.plan
    managed = {*plan.engines, *plan.trainers, *plan.late_start}
    for name, cluster in clusters.items():
        if not is_stateless(name) or name in managed or _in_a_group(cfg, name, cluster):
            continue
        if name == "actor_infer":
            recovery.watch(cluster, restore=restore_engines)
        else:
            recovery.watch(cluster)
    return recovery


def _in_a_group(cfg: RLVRConfig, name: str, cluster: Any) -> bool:
    """Whether the role's ranks form a DeepSpeed process group at start (a new rank could not
    rejoin it)."""
    role = cfg.rewards.get(name.removeprefix("rewards.")) if "." in name else getattr(cfg, name)
    strategy = getattr(getattr(role, "strategy_args", None), "strategy_name", None) or ""
    return cluster.world_size > 1 and strategy.startswith("deepspeed")


class MainThreadRestore:
    """A ``Restore`` that runs on the thread that made it (the driver's main thread, the only
    one that calls the trainer): called from another thread (a rollout thread of
    ``async_generation``), it waits until the main thread runs ``serve``, and raises what the
    restore raised there. ``close`` fails the waiting ones (the run is ending)."""

    def __init__(self, restore: Restore) -> None:
        self._restore = restore
        self._owner = threading.get_ident()
        self._pending: queue.SimpleQueue[tuple[Any, list[int], Future]] = queue.SimpleQueue()
        self._closed = False

    def __call__(self, cluster: Any, ranks: list[int]) -> None:
        if threading.get_ident() == self._owner:
            self._restore(cluster, ranks)
            return
        done: Future = Future()
        self._pending.put((cluster, ranks, done))
        if self._closed:  # put after close drained: nobody would serve it
            self._fail_pending()
        done.result()

    def serve(self) -> None:
        """Run the restores other threads wait for (on the owner thread; elsewhere a no-op)."""
        if threading.get_ident() != self._owner:
            return
        while True:
            try:
                cluster, ranks, done = self._pending.get_nowait()
            except queue.Empty:
                return
            try:
                self._restore(cluster, ranks)
            except BaseException as exc:  # the waiting thread raises it (its step fails)
                done.set_exception(exc)
            else:
                done.set_result(None)

    def close(self) -> None:
        self._closed = True
        self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                _, _, done = self._pending.get_nowait()
            except queue.Empty:
                return
            if not done.done():
                done.set_exception(RuntimeError("the run ended before the engine was restored"))
