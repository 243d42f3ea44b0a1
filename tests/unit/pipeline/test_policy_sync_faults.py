"""An engine that dies inside a weight sync (roll_ds/pipeline/policy_sync.py ``_transfer``):
the old transport left without the dead rank, the dead replaced, and the full sync done again
into every engine over a transport connected anew (a collective one: its group re-formed); a
trainer that failed too stops the run as before. The transports and the engines' cluster are
stand-ins for the Ray side; the replacement goes through the real ``Recovery``."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.errors import WorkerError, WorkerTimeoutError
from roll_ds.distributed.recovery import Recovery
from roll_ds.pipeline.colocation.choreography import Choreography
from roll_ds.pipeline.colocation.plan import ColocationPlan
from roll_ds.pipeline.engines import RolloutEngines
from roll_ds.pipeline.policy_sync import PolicySync
from roll_ds.weight_sync.base import WeightSyncError


class _Worker:
    def initialize(self) -> None: ...


class Engines:
    name = "actor_infer"
    worker_cls = _Worker
    world_size = 2

    def __init__(self) -> None:
        self.recovery = None
        self.incarnations = [0, 0]
        self.log: list[tuple] = []

    def replace_rank(self, rank: int) -> None:
        self.incarnations[rank] += 1
        self.log.append(("replace", rank))

    def call_ranks(self, method: str, ranks) -> None:
        self.log.append((method, tuple(ranks)))

    def record_shm(self) -> None: ...


class Transport:
    """Fails its first sync with ``failures`` (if any; ``causes``: what broke it, default the
    failures), then syncs."""

    def __init__(self, name: str, log: list, failures: tuple = (), causes: tuple = ()) -> None:
        self.name, self.log, self.failures, self.causes = name, log, failures, causes

    def sync(self, train, infer) -> dict[str, float]:
        if self.failures:
            failures, self.failures = self.failures, ()
            raise WeightSyncError("weight sync (x) failed", failures, self.causes or failures)
        self.log.append(("sync", self.name, tuple(infer.incarnations)))
        return {"sync/seconds": 0.1, "sync/receivers": 2.0}

    def close(self, train, infer, *, dead=()) -> None:
        self.log.append(("close", self.name, tuple(dead), tuple(infer.incarnations)))


def died(role: str, rank: int) -> WorkerError:
    return WorkerError(role, rank, "receive_weights", ActorDiedError())


def _sync(
    name: str, failures: tuple, max_restarts: int = 3, causes: tuple = ()
) -> tuple[PolicySync, Engines]:
    cfg = RLVRConfig()
    cfg.weight_sync.parity_check = False
    engines = Engines()
    Recovery(max_restarts).watch(engines, restore=lambda c, ranks: engines.log.append("restore"))
    sync = PolicySync(cfg, "train", RolloutEngines(engines), Choreography(ColocationPlan()), [], 0)
    sync.transport = Transport(name, engines.log, failures, causes)
    sync._build_transport = lambda: engines.log.append(("connect",)) or Transport(name, engines.log)
    return sync, engines


@pytest.mark.parametrize("name", ["object_store", "collective", "cuda_ipc"])
def test_an_engine_that_dies_in_a_sync_is_replaced_and_the_sync_done_again(name):
    sync, engines = _sync(name, (died("actor_infer", 1),))
    metrics = sync.sync(3)
    assert engines.log == [
        # the old transport left by the trainer and rank 0 only, before rank 1 is replaced
        ("close", name, (1,), (0, 0)),
        ("replace", 1),
        ("initialize", (1,)),
        ("connect",),  # a new transport: a collective one seats the new rank in a new group
        ("sync", name, (0, 1)),  # the full sync again, into the new rank too
    ]  # and no restore of its own: the sync redone is it
    assert metrics["sync/receivers"] == 2.0 and sync.rollout_version == 3
    assert engines.recovery.pop_metrics()["faults/actor_infer/restarts"] == 1.0


def test_an_engine_stuck_in_a_sync_is_replaced_though_the_trainer_failed_waiting_on_it():
    """``causes`` blame the engine that stopped answering, not the trainer rank whose
    broadcast timed out waiting on it (``weight_sync.base.stuck_workers``)."""
    waited = WorkerError("actor_train", 0, "weight_sync_send", RayTaskError("f", "tb", OSError()))
    stuck = WorkerTimeoutError("actor_infer", "receive_weights", [1], 3.0)
    sync, engines = _sync("collective", (waited,), causes=(stuck,))
    sync.sync(3)
    assert engines.log[:3] == [
        ("close", "collective", (1,), (0, 0)),  # the stuck rank is not waited on
        ("replace", 1),
        ("initialize", (1,)),
    ]
    assert engines.log[-1] == ("sync", "collective", (0, 1))


def test_replaced_engines_are_restored_over_a_transport_connected_anew():
    """``restore_engines`` (a rank replaced outside a sync): the old transport is left without
    the replaced rank, a new one connects every engine, and the full sync runs over it."""
    sync, engines = _sync("collective", ())
    sync.sync(3)
    engines.incarnations[1] += 1  # Recovery replaced rank 1 (in a generate call, say)
    engines.log.clear()
    sync.restore_engines(engines, [1])
    assert engines.log == [
        ("close", "collective", (1,), (0, 1)),
        ("connect",),
        ("sync", "collective", (0, 1)),
    ]
    assert sync.rollout_version == 3
    assert sync.pop_metrics() == {"faults/actor_infer/sync/seconds": 0.1}


def test_a_survivor_that_cannot_leave_the_old_group_stops_the_sync_naming_it():
    sync, engines = _sync("collective", (died("actor_infer", 1),))
    left_stuck = WeightSyncError(
        "weight sync (collective) timed out",
        causes=(WorkerTimeoutError("actor_infer", "weight_sync_leave", [0], 6.0),),
    )

    def close(train, infer, *, dead=()):
        raise left_stuck

    sync.transport.close = close
    with pytest.raises(WeightSyncError) as info:
        sync.sync(3)
    assert info.value is left_stuck
    assert engines.log == []  # nothing replaced: the run stops naming rank 0


def test_a_trainer_failure_or_a_method_error_or_no_budget_stops_as_before():
    raised = WorkerError("actor_infer", 0, "receive_weights", RayTaskError("f", "tb", OSError()))
    for failures, max_restarts in (
        ((died("actor_infer", 1), died("actor_train", 0)), 3),  # the run's restart
        ((raised,), 3),  # a new engine would raise it again
        ((died("actor_infer", 1),), 0),  # max_restarts 0: not watched
    ):
        sync, engines = _sync("object_store", failures, max_restarts)
        with pytest.raises(WeightSyncError):
            sync.sync(3)
        assert engines.log == []
