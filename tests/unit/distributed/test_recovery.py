"""Replacing dead ranks in place (roll_ds/distributed/recovery.py) through the real
``PendingCall.get``; the cluster below it is a hand-written fake of the Ray side (what each rank
answers, which ranks are replaced)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from roll_ds.distributed.cluster import PendingCall
from roll_ds.distributed.dispatch import Dispatch, DispatchSpec
from roll_ds.distributed.errors import WorkerError, WorkerTimeoutError
from roll_ds.distributed.recovery import CallBounds, Recovery, is_dead


class _Worker:
    def initialize(self) -> None: ...


class FakeCluster:
    """Ranks answer ``rank * 10 + generation``; ``fail`` lists, per rank, the errors its next
    attempts raise (a rank's generation goes up each time it is replaced)."""

    def __init__(self, name: str, world_size: int, fail: dict[int, list[str]]) -> None:
        self.name, self.world_size, self.fail = name, world_size, fail
        self.generation = [0] * world_size
        self.incarnations = self.generation  # Cluster's name for it
        self.recovery = None
        self.worker_cls = _Worker
        self.call_timeout_s = 5.0
        self._in_flight: list = []
        self.log: list[tuple] = []

    def _gather(self, method, ranks, refs, timeout_s):
        out = []
        for rank, ref in zip(ranks, refs, strict=True):
            kind = self.fail.get(rank, [None]).pop(0) if self.fail.get(rank) else None
            if kind == "died":
                raise WorkerError(self.name, rank, method, ActorDiedError())
            if kind == "raised":
                raise WorkerError(self.name, rank, method, RayTaskError("f", "tb", ValueError()))
            if kind == "stuck":
                raise WorkerTimeoutError(self.name, method, [rank], timeout_s)
            out.append(ref)
        return out

    def _unfinished(self):
        return []

    def replace_rank(self, rank):
        self.generation[rank] += 1
        self.log.append(("replace", rank))

    def call_ranks(self, method, ranks):
        self.log.append((method, tuple(ranks)))

    def record_shm(self):
        self.log.append(("record_shm",))

    def _resend(self, method, call):
        rank, args, _ = call
        self.log.append(("resend", rank, args))
        return rank * 10 + self.generation[rank]


def pending(cluster: FakeCluster, method: str = "score", before_resend=None) -> PendingCall:
    calls = [(r, (f"shard{r}",), {}) for r in range(cluster.world_size)]
    refs = [r * 10 for r in range(cluster.world_size)]
    call = PendingCall(
        cluster, method, DispatchSpec(Dispatch.ALL), calls, refs, before_resend=before_resend
    )
    call.incarnations = dict(enumerate(cluster.incarnations))  # as Cluster.submit records them
    return call


def test_a_dead_rank_is_replaced_brought_up_and_sent_its_share_again():
    cluster = FakeCluster("rewards.math", 2, {1: ["died"]})
    restored = []
    recovery = Recovery(max_restarts=3)
    recovery.watch(cluster, restore=lambda c, ranks: restored.append(ranks))
    assert pending(cluster).get() == [0, 11]  # rank 1 answered from its replacement
    assert cluster.log == [
        ("replace", 1),
        ("initialize", (1,)),
        ("record_shm",),
        ("resend", 1, ("shard1",)),
    ]
    assert restored == [[1]]
    metrics = recovery.pop_metrics()
    assert metrics["faults/rewards.math/restarts"] == 1.0
    assert metrics["faults/rewards.math/lost_s"] >= 0.0
    # the count stays for the run; lost seconds are the step's
    assert recovery.pop_metrics() == {"faults/rewards.math/restarts": 1.0}


def test_a_stuck_rank_is_treated_as_dead():
    cluster = FakeCluster("reference", 2, {0: ["stuck"]})
    Recovery(max_restarts=1).watch(cluster)
    assert pending(cluster).get() == [1, 10]
    assert ("replace", 0) in cluster.log


def test_an_exception_the_method_raised_is_not_a_death():
    cluster = FakeCluster("rewards.math", 1, {0: ["raised"]})
    Recovery(max_restarts=3).watch(cluster)
    with pytest.raises(WorkerError):
        pending(cluster).get()
    assert cluster.log == []  # nothing replaced: the new rank would raise it again


def test_the_budget_is_per_role_over_the_run_and_the_error_names_the_field():
    cluster = FakeCluster("actor_infer", 1, {0: ["died", "died"]})
    recovery = Recovery(max_restarts=1)
    recovery.watch(cluster)
    with pytest.raises(WorkerError) as info:
        pending(cluster).get()
    assert "1 of fault_tolerance.max_restarts=1 replacements used" in str(info.value.__notes__)
    assert recovery.restarts == {"actor_infer": 1}


def test_max_restarts_0_and_unwatched_roles_fail_as_before():
    for recovery in (Recovery(max_restarts=0), None):
        cluster = FakeCluster("rewards.math", 1, {0: ["died"]})
        if recovery is not None:
            recovery.watch(cluster)
        assert cluster.recovery is None
        with pytest.raises(WorkerError):
            pending(cluster).get()


def test_recover_false_only_reads_the_error():
    cluster = FakeCluster("rewards.math", 1, {0: ["died"]})
    Recovery(max_restarts=3).watch(cluster)
    with pytest.raises(WorkerError):
        pending(cluster).get(0, recover=False)
    assert cluster.log == []


def test_is_dead_and_call_bounds():
    assert is_dead(WorkerError("r", 0, "m", ActorDiedError()))
    assert not is_dead(WorkerError("r", 0, "m", ValueError()))
    assert is_dead(WorkerTimeoutError("r", "generate", [0, 1], 5))
    assert not is_dead(WorkerTimeoutError("r", "__init__", [0], 5))  # never started: no retry
    assert CallBounds(base_s=60, per_token_s=0.5).tokens(100) == 110.0


def test_a_rank_another_caller_replaced_already_is_only_sent_its_share_again():
    """Two calls in flight on the rank that died (two rollout threads): the first to see it
    replaces it; the second, sent to the dead incarnation too, finds it replaced and only
    sends its share again (one restart counted, one restore)."""
    cluster = FakeCluster("actor_infer", 2, {1: ["died"]})
    restored = []
    recovery = Recovery(max_restarts=1)
    recovery.watch(cluster, restore=lambda c, ranks: restored.append(ranks))
    first, second = pending(cluster, "generate"), pending(cluster, "generate")
    assert first.get() == [0, 11]
    cluster.fail[1] = ["died"]  # the second call, sent to the same dead process
    assert second.get() == [0, 11]
    assert [e for e in cluster.log if e[0] == "replace"] == [("replace", 1)]
    assert restored == [[1]]
    assert recovery.restarts == {"actor_infer": 1}
    assert [e for e in cluster.log if e[0] == "resend"] == [
        ("resend", 1, ("shard1",)),
        ("resend", 1, ("shard1",)),
    ]


def test_a_replaced_rank_gets_what_it_lost_before_its_share_is_sent_again():
    """``before_resend`` (a streamed call: the requests the dead engine held) runs for the
    replaced rank only, after its restore and before the call is sent again."""
    cluster = FakeCluster("actor_infer", 3, {2: ["died"]})
    recovery = Recovery(max_restarts=3)
    recovery.watch(cluster, restore=lambda c, ranks: cluster.log.append(("restore", ranks)))
    call = pending(cluster, "collect_stream", lambda rank: cluster.log.append(("again", rank)))
    assert call.get() == [0, 10, 21]
    assert cluster.log == [
        ("replace", 2),
        ("initialize", (2,)),
        ("restore", [2]),
        ("record_shm",),
        ("again", 2),
        ("resend", 2, ("shard2",)),
    ]


def test_replace_without_restore_and_the_lock_across_threads():
    """``restore=False``: the caller restores (a weight sync redone); while a thread holds
    ``locked()`` another thread's replacement waits, and the waiting thread runs ``idle``."""
    import threading

    cluster = FakeCluster("actor_infer", 1, {})
    restored = []
    recovery = Recovery(max_restarts=2)
    recovery.watch(cluster, restore=lambda c, ranks: restored.append(ranks))
    idled = threading.Event()
    recovery.idle = idled.set
    dead = WorkerError("actor_infer", 0, "receive_weights", ActorDiedError())
    with recovery.locked():
        assert recovery.replace(cluster, dead, 0.0, restore=False) == [0]
        waiter = threading.Thread(
            target=recovery.replace, args=(cluster, dead, 0.0, {0: 0}), daemon=True
        )
        waiter.start()
        assert idled.wait(5)  # it waits for the lock, serving meanwhile
        assert waiter.is_alive()
    waiter.join(5)
    assert restored == []  # the second found rank 0 replaced since its call (incarnation 0)
    assert recovery.restarts == {"actor_infer": 1}
