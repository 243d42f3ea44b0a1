"""When the driver restarts a run whose trainer rank failed, and what the restarts cost.

A trainer rank (``actor_train``, ``critic``: ``roll_ds.config.roles.TRAIN_ROLES``) holds its
ZeRO shard of the weights and of the optimizer, which no other process has: when one dies the run
cannot go on in place. ``launch.run_pipeline`` then tears down every role and builds the pipeline
again from ``next_config`` (``resume_from_checkpoint=latest``, or where the run first started when
it has saved nothing since), up to ``fault_tolerance.max_trainer_restarts`` times. The resumed run
is a manual ``resume_from_checkpoint=latest`` run: same data order, RNG and work in flight.

What is restarted: a ``WorkerError`` or ``WorkerTimeoutError`` of a trainer role, or a cluster
error (a failed weight sync) whose causes include one (a trainer rank that died, raised or
stopped answering in the sync: ``weight_sync.base.stuck_workers``), raised directly or as the
``__cause__`` of what the loop raised. Never restarted: any other error (a bug in the driver, a
rollout or reward role; those have their own policy), a checkpoint that fails to load
(``CheckpointError``: a restart would load the same files), a failure while the first attempt starts
its roles (a config or environment problem: starting again repeats it), and a failure while a
restart starts them (``RestartError``: the roles cannot be placed again, say because a node is
gone and no other node has room).

The cost is reported with the metrics of every step after a restart: ``faults/restarts`` (the
count) and ``faults/lost_seconds``: wall-clock from the last progress the failed attempt kept
(its last checkpoint, else the moment it began training) to the restarted run being back there,
summed over the restarts: the training to redo plus teardown, start-up and load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from roll_ds.checkpoint import LATEST, CheckpointError, CheckpointManager
from roll_ds.config.roles import TRAIN_ROLES
from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.errors import ClusterError, WorkerError, WorkerTimeoutError

logger = logging.getLogger(__name__)


class RestartError(ClusterError):
    """The driver gave up restarting: restarts exhausted, or a restart could not start the
    roles again. The failure it gave up on is the ``__cause__``."""


def failed_trainer(exc: BaseException) -> str | None:
    """``"<role> rank <r>"`` of the trainer whose failure ``exc`` reports, else None (the run
    is not restarted for it)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:  # explicit chaining only (raise from)
        seen.add(id(error))
        if isinstance(error, WorkerError) and error.role in TRAIN_ROLES:
            return f"{error.role} rank {error.rank}"
        if isinstance(error, WorkerTimeoutError) and error.role in TRAIN_ROLES:
            return f"{error.role} ranks {error.ranks}"
        if isinstance(error, ClusterError):  # a weight sync's (weight_sync.base.WeightSyncError)
            # its causes: the ranks that died, raised or stopped answering, not those that only
            # waited on them (a trainer whose broadcast broke because an engine died is fine)
            blamed = getattr(error, "causes", ()) or getattr(error, "failures", ())
            for failure in blamed:
                found = failed_trainer(failure)
                if found:
                    return found
        error = error.__cause__
    return None


def checkpoint_error(exc: BaseException) -> CheckpointError | None:
    """The ``CheckpointError`` ``exc`` is or was raised from (explicit chaining), else None."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, CheckpointError):
            return error
        error = error.__cause__
    return None


class TrainerRestarts:
    """The restart policy of one ``run_pipeline`` call and its ``faults/*`` metrics.

    ``launch.run_pipeline`` calls ``on_failure`` with what an attempt raised (it raises unless
    the run is to be restarted) and builds the next attempt from ``next_config``; the pipeline
    calls ``progress`` after each checkpoint it saves and ``resumed`` once it has loaded the one
    it goes on from, and merges ``metrics()`` into each row it logs."""

    def __init__(self, cfg: RLVRConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.limit = cfg.fault_tolerance.max_trainer_restarts
        self.count = 0
        self.lost_s = 0.0
        self._clock = clock
        self._progress_at = clock()  # the time from which a failure now loses the work done
        self._failed_from: float | None = None  # a restart's loss started here; not resumed yet
        self.last_failure: str | None = None
        # the tracker's run id, across attempts: a restart goes on as the same W&B run also
        # when it starts again from step 0 (no checkpoint yet to keep the id)
        self.run_id: str | None = None

    def next_config(self, checkpoints: Path) -> RLVRConfig:
        """The config of the next attempt: the run's own at first; after a restart, resuming
        from the latest checkpoint, or where the run first started (its own
        ``resume_from_checkpoint``, or step 0) when there is none: a run that saved nothing
        yet loses at most ``save_steps`` steps, and from step 0 the same seed replays it."""
        if self.count == 0:
            return self.cfg
        if CheckpointManager(checkpoints).latest() is not None:
            return replace(self.cfg, resume_from_checkpoint=LATEST)
        return self.cfg

    def on_failure(self, exc: Exception, *, started: bool) -> None:
        """Return if the run is to be restarted after ``exc``; else raise (``exc`` itself, or
        ``RestartError`` from it). ``started``: the attempt's roles were all up."""
        trainer = failed_trainer(exc)
        damaged = checkpoint_error(exc)
        if damaged is not None:  # loading it again reads the same files
            logger.error("%s; not restarted", damaged)
            raise exc
        if not started:
            if self.count:  # a restart could not bring the roles up again
                raise RestartError(
                    f"automatic restart {self.count} of {self.limit} (after {self.last_failure} "
                    f"failed) could not start the roles again: {type(exc).__name__}: {exc}"
                ) from exc
            raise exc  # the first start: a config or environment problem, not a fault
        if trainer is None:
            raise exc
        if self.count >= self.limit:
            if self.limit == 0:
                raise exc  # restarts are off: the run stops as it always has
            raise RestartError(
                f"{trainer} failed again after {self.count} automatic restart(s) "
                f"(fault_tolerance.max_trainer_restarts={self.limit}); giving up. Raise "
                "fault_tolerance.max_trainer_restarts if the failures are transient, or look "
                "at the error below if each restart meets the same one; the run resumes by "
                "hand with resume_from_checkpoint=latest"
            ) from exc
        self.count += 1
        self.last_failure = trainer
        self._failed_from = self._progress_at
        logger.error(
            "%s failed (%s: %s); restarting the run from its latest checkpoint "
            "(automatic restart %d of %d, fault_tolerance.max_trainer_restarts)",
            trainer,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
            self.count,
            self.limit,
        )

    def progress(self) -> None:
        """The run saved a checkpoint: a failure from now on loses only what follows."""
        self._progress_at = self._clock()

    def resumed(self) -> None:
        """The restarted run is back where the failed one had got to (its checkpoint loaded)."""
        now = self._clock()
        if self._failed_from is not None:
            self.lost_s += now - self._failed_from
            self._failed_from = None
        self._progress_at = now

    def metrics(self) -> dict[str, float]:
        """``faults/*`` once the run has been restarted (none before: an undisturbed run logs
        what it always has)."""
        if not self.count:
            return {}
        return {"faults/restarts": float(self.count), "faults/lost_seconds": self.lost_s}
