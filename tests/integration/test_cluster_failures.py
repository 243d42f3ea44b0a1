"""A dying or failing worker surfaces fast as an error naming role, rank and node; an
unsatisfiable placement fails fast. One local Ray with devices as CPU slots (the CPU-box path).
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import time
import uuid

import pytest

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402
from ray.util.placement_group import (  # noqa: E402
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from roll_ds.distributed.cluster import Cluster  # noqa: E402
from roll_ds.distributed.dispatch import Dispatch, register  # noqa: E402
from roll_ds.distributed.errors import PlacementError, WorkerError, WorkerTimeoutError  # noqa: E402
from roll_ds.distributed.placement import RoleSpec  # noqa: E402
from roll_ds.distributed.ray_init import connect  # noqa: E402
from roll_ds.distributed.resource_manager import ResourceManager  # noqa: E402
from roll_ds.distributed.worker import Worker  # noqa: E402

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BOUND_S = 30.0  # a failure must surface well within this


class Flaky(Worker):
    def ping(self) -> int:
        return self.rank

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad input on rank {rank}")
        return self.rank

    def crash_on(self, rank: int) -> int:
        """``rank`` dies like an OOM kill (SIGKILL); the others hang as if in a collective."""
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
        return self.rank

    @register(Dispatch.RANK0)
    def slow(self, seconds: float) -> None:
        time.sleep(seconds)


class ShmHolder(Worker):
    """Holds a file of its own in /dev/shm, as a vLLM engine or DeepSpeed's shm op does;
    its ``close`` unlinks it, as theirs do at an orderly end."""

    def make(self, prefix: str) -> str:
        import mmap

        self.path = f"/dev/shm/{prefix}_{self.rank}"
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 20)
        self.map = mmap.mmap(fd, 1 << 20)
        os.close(fd)
        return os.path.basename(self.path)

    def crash_on(self, rank: int) -> int:
        return Flaky.crash_on(self, rank)

    @register(Dispatch.ALL)
    def close(self) -> None:
        os.unlink(self.path)
        super().close()


class BrokenInit(Worker):
    def __init__(self) -> None:
        super().__init__()
        if self.rank == 1:
            raise RuntimeError("no model weights on this node")


@pytest.fixture(scope="module")
def local_ray():
    saved = os.environ.pop("RAY_ADDRESS", None)
    conn = connect(num_cpus=4, log_to_driver=False)
    yield conn
    ray.shutdown()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


@pytest.fixture(scope="module")
def rm(local_ray):
    manager = ResourceManager(
        {"actor_train": RoleSpec((0, 1), 2), "rewards.math": RoleSpec((), 1, 0)},
        num_gpus_per_node=2,
        device_resource="CPU",
        ready_timeout_s=30,
    ).reserve()
    yield manager
    manager.release()
    left = {
        pg["name"]: pg["state"]
        for pg in placement_group_table().values()
        if pg["name"].startswith("roll_ds-") and pg["state"] != "REMOVED"
    }
    assert not left, f"placement groups left after release: {left}"


def test_connect_started_a_local_ray(local_ray):
    assert local_ray.started_local and local_ray.address is None
    assert local_ray.resources["CPU"] == 4
    assert local_ray.init_s > 0


def elapsed(fn) -> tuple[BaseException, float]:
    start = time.perf_counter()
    with pytest.raises(Exception) as info:
        fn()
    return info.value, time.perf_counter() - start


def wait_for_exit(pid: int, timeout_s: float = BOUND_S) -> None:
    """``ray.kill`` only asks the GCS to kill the actor; until its process is gone a
    call sent straight to it can still be answered. Wait for the process to exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker pid {pid} still alive {timeout_s} s after ray.kill")


def test_killed_worker_is_reported_with_role_rank_and_node(rm):
    train = Cluster("actor_train", Flaky, rm)
    try:
        assert train.ping() == [0, 1]
        node = train.infos[1]["node_id"]
        ray.kill(train.actors[1])
        wait_for_exit(train.infos[1]["pid"])
        err, took = elapsed(train.ping)
        assert isinstance(err, WorkerError)
        print(f"killed worker surfaced after {took:.3f} s")
        assert took < BOUND_S
        assert (err.role, err.rank, err.node_id) == ("actor_train", 1, node)
        assert str(err).startswith(f"actor_train rank 1 on node {node[:12]}")
        assert "ActorDiedError" in str(err) and "killed by `ray.kill`" in str(err)
    finally:
        train.shutdown()


def test_crash_mid_call_does_not_wait_for_the_other_ranks(rm):
    train = Cluster("actor_train", Flaky, rm)
    try:
        err, took = elapsed(lambda: train.crash_on(0))
        assert isinstance(err, WorkerError) and err.rank == 0, err
        print(f"SIGKILLed worker surfaced after {took:.3f} s")
        assert took < BOUND_S  # rank 1 is still sleeping 600 s
        assert "actor_train rank 0" in str(err)
    finally:
        train.shutdown()


def test_exception_in_a_method_carries_the_original(rm):
    rewards = Cluster("rewards.math", Flaky, rm)
    try:
        err, _ = elapsed(lambda: rewards.fail_on(0))
        assert isinstance(err, WorkerError)
        assert isinstance(err.cause.cause, ValueError)
        assert "rewards.math rank 0" in str(err)
        assert "failed in fail_on(): ValueError: bad input on rank 0" in str(err)
    finally:
        rewards.shutdown()


def test_stuck_call_times_out_naming_the_ranks(rm):
    rewards = Cluster("rewards.math", Flaky, rm)
    try:
        err, took = elapsed(lambda: rewards.call("slow", 30, _timeout_s=1))
        assert isinstance(err, WorkerTimeoutError) and err.ranks == [0]
        assert took < 10
        assert "rewards.math.slow(): ranks [0] did not answer within 1 s" in str(err)
    finally:
        rewards.shutdown()


def test_failing_init_is_reported_and_cleaned_up(rm):
    err, took = elapsed(lambda: Cluster("actor_train", BrokenInit, rm, start_timeout_s=60))
    assert isinstance(err, WorkerError) and err.rank == 1 and err.method == "__init__"
    assert "no model weights on this node" in str(err)
    assert took < 60
    # the failed start gave its bundle back: a new cluster fits again
    Cluster("actor_train", Flaky, rm).shutdown()


def test_held_resources_fail_fast_instead_of_waiting(local_ray, rm):
    # rm holds 2 of 4 CPUs; take 2 more so nothing is free for a second plan
    hog = placement_group([{"CPU": 2}])
    ray.get(hog.ready(), timeout=30)
    try:
        other = ResourceManager(
            {"critic": RoleSpec((0, 1), 2)},
            num_gpus_per_node=2,
            device_resource="CPU",
            ready_timeout_s=30,
        )
        err, took = elapsed(other.reserve)
        assert isinstance(err, PlacementError) and took < 5
        assert "placement needs 2 CPU for 2 device bundle(s) on node(s) [0]" in str(err)
        assert "free in the Ray cluster (total 4)" in str(err)
    finally:
        remove_placement_group(hog)


@pytest.fixture
def shm_prefix():
    prefix = f"roll_ds_test_{uuid.uuid4().hex[:8]}"
    yield prefix
    for path in glob.glob(f"/dev/shm/{prefix}_*"):  # whatever a failing test left
        os.unlink(path)


def test_a_crashed_rank_and_a_stuck_one_leave_no_shm_file_and_no_wait(rm, shm_prefix):
    """Rank 0 SIGKILLed mid-call (its file recorded after start-up, its holder gone), rank 1
    stuck in the same call (not closed: it would answer after 600 s): ``shutdown`` kills both at
    once and sweeps both files, and leaves the file it did not see a rank hold."""
    train = Cluster("actor_train", ShmHolder, rm)
    other = f"/dev/shm/{shm_prefix}_other"  # another run's: made by this process, not a rank
    with open(other, "wb") as f:
        f.write(b"x")
    try:
        names = train.make(shm_prefix)
        train.record_shm()
        assert set(train.shm.recorded(train.infos[0]["node_id"])) == set(names)
        err, _ = elapsed(lambda: train.crash_on(0))
        assert isinstance(err, WorkerError) and err.rank == 0
        assert train.busy_ranks() == {1}
    finally:
        start = time.perf_counter()
        removed = train.shutdown()
        took = time.perf_counter() - start
    assert sorted(removed) == sorted(names) and took < 10, (removed, took)
    assert glob.glob(f"/dev/shm/{shm_prefix}_*") == [other]


def test_idle_ranks_close_before_the_kill(rm, shm_prefix):
    """An orderly end: every rank's ``close`` runs (and unlinks its file) before the kill, so
    the sweep finds nothing left; the bundles go back to the manager."""
    train = Cluster("actor_train", ShmHolder, rm)
    try:
        train.make(shm_prefix)
        train.record_shm()
    finally:
        assert train.shutdown() == {}
    assert glob.glob(f"/dev/shm/{shm_prefix}_*") == []
    Cluster("actor_train", Flaky, rm).shutdown()  # the bundles are free again


class Replaceable(Worker):
    """A stateless rank: ``initialize`` makes its /dev/shm file (named by its pid); rank 1 dies
    (SIGKILL) in its first ``work`` call of the test, its replacement answers."""

    def __init__(self, prefix: str, marker: str) -> None:
        super().__init__()
        self.prefix, self.marker = prefix, marker

    def initialize(self) -> None:
        ShmHolder.make(self, f"{self.prefix}_{os.getpid()}")

    def work(self, x: int) -> int:
        if self.rank == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.rank * 10 + x

    @register(Dispatch.RANK0)
    def slow(self, seconds: float) -> None:
        time.sleep(seconds)


def test_a_rank_killed_mid_call_is_replaced_in_place_and_its_share_redone(rm, shm_prefix, tmp_path):
    """fault_tolerance: the dead rank's share of the call is answered by a new actor on the
    same bundle, brought up by ``initialize``; the dead one's /dev/shm file is swept while the
    live rank's stays; past max_restarts the death stops the call, naming the field."""
    from roll_ds.distributed.recovery import Recovery

    marker = str(tmp_path / "died")
    cluster = Cluster("actor_train", Replaceable, rm, init_args=(shm_prefix, marker))
    recovery = Recovery(max_restarts=1)
    recovery.watch(cluster)
    try:
        cluster.initialize()
        cluster.record_shm()
        pids = [i["pid"] for i in cluster.infos]
        bundle = cluster.placements[1].options["scheduling_strategy"].placement_group_bundle_index
        started = time.perf_counter()
        assert cluster.work(5) == [5, 15]
        took = time.perf_counter() - started
        print(f"replaced a SIGKILLed rank and redid its share in {took:.2f} s")
        new_pid = cluster.infos[1]["pid"]
        assert new_pid != pids[1] and cluster.infos[0]["pid"] == pids[0]
        assert (
            cluster.placements[1].options["scheduling_strategy"].placement_group_bundle_index
            == bundle
        )
        files = {os.path.basename(p) for p in glob.glob(f"/dev/shm/{shm_prefix}_*")}
        assert files == {f"{shm_prefix}_{pids[0]}_0", f"{shm_prefix}_{new_pid}_1"}
        metrics = recovery.pop_metrics()
        assert metrics["faults/actor_train/restarts"] == 1.0
        assert 0 < metrics["faults/actor_train/lost_s"] < BOUND_S

        os.unlink(marker)  # rank 1 dies again: the budget (1) is spent
        err, took = elapsed(lambda: cluster.work(5))
        assert isinstance(err, WorkerError) and err.rank == 1 and took < BOUND_S
        assert "fault_tolerance.max_restarts=1" in "".join(err.__notes__)
    finally:
        cluster.shutdown()
    assert glob.glob(f"/dev/shm/{shm_prefix}_*") == []


def test_a_hung_rank_is_replaced_then_fails_naming_the_ranks_within_the_bound(rm, tmp_path):
    """A rank that stops answering is treated as dead: replaced, its call sent again; when the
    new one hangs too and the budget is spent, ``WorkerTimeoutError`` names the rank."""
    from roll_ds.distributed.recovery import Recovery

    cluster = Cluster("rewards.math", Replaceable, rm, init_args=("unused", str(tmp_path / "m")))
    recovery = Recovery(max_restarts=1)
    recovery.watch(cluster)
    old = cluster.infos[0]["pid"]
    try:
        err, took = elapsed(lambda: cluster.call("slow", 60, _timeout_s=2))
        print(f"hung rank: replaced once, then failed after {took:.2f} s")
        assert isinstance(err, WorkerTimeoutError) and err.ranks == [0]
        assert "rewards.math.slow(): ranks [0] did not answer within 2 s" in str(err)
        assert took < 2 * 2 + BOUND_S  # two bounded tries and one replacement
        assert cluster.infos[0]["pid"] != old and recovery.restarts == {"rewards.math": 1}
    finally:
        cluster.shutdown()
