"""A rollout engine that dies under ``async_generation`` (stream and batch), on real Ray
actors: the calls come from rollout threads, the restore (the weights) runs on the main thread
while it waits for them, and the work the dead engine held goes to its replacement.

The engine is a stand-in for vLLM (``generate`` blocks; ``submit_stream`` keeps the requests,
``collect_stream`` answers them in its own concurrency group); the cluster, its recovery, the
threads' calls (``RolloutEngines``) and the restore broker are the pipeline's. ~10 s a test
after Ray's start.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest
from _ray_roles import reserved

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402

from roll_ds.agentic.runner import TurnRequest  # noqa: E402
from roll_ds.distributed.batch import Batch  # noqa: E402
from roll_ds.distributed.cluster import Cluster  # noqa: E402
from roll_ds.distributed.dispatch import Dispatch, register  # noqa: E402
from roll_ds.distributed.placement import RoleSpec  # noqa: E402
from roll_ds.distributed.recovery import Recovery  # noqa: E402
from roll_ds.distributed.worker import Worker  # noqa: E402
from roll_ds.pipeline.engines import RolloutEngines  # noqa: E402
from roll_ds.pipeline.faults import MainThreadRestore  # noqa: E402
from roll_ds.pipeline.rollout_queue import InFlight  # noqa: E402
from roll_ds.pipeline.workers import STREAM_WAIT, stream_wait  # noqa: E402

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StreamEngine(Worker):
    """Answers each request with ``[row, weights version]``. Rank 1 SIGKILLs itself in its
    first ``collect_stream`` once two batches are in it (the marker file absent): both
    threads' requests die with it."""

    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {STREAM_WAIT: 4}

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.version = -1  # no weights yet: a replacement must be restored before it answers
        self.batches: dict[str, list[int]] = {}

    @register(Dispatch.ALL)
    def initialize(self) -> None: ...

    @register(Dispatch.ALL)
    def load(self, version: int) -> None:
        self.version = version

    @register(Dispatch.DP)
    def submit_stream(self, batch: Batch, *, tag: str, seed: int, n: int, **sampling) -> None:
        self.batches[tag] = [int(r) for r in batch["row"]]

    @register(Dispatch.ALL)
    @stream_wait
    def collect_stream(self, tag: str) -> Batch:
        if self.rank == 1 and not os.path.exists(self.marker):
            deadline = time.monotonic() + 10
            while len(self.batches) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # the other thread's batch too
            time.sleep(0.5)  # and its collect call
            self._die()
        return self._answer(self.batches.pop(tag))

    @register(Dispatch.DP)
    def generate(self, batch: Batch, *, seed: int, n: int, **sampling) -> Batch:
        """mode batch: one blocking call; rank 1 dies in its first one, with the other
        thread's call queued behind it (the default group runs one call at a time)."""
        if self.rank == 1 and not os.path.exists(self.marker):
            time.sleep(1.0)
            self._die()
        return self._answer([int(r) for r in batch["row"]])

    def _die(self) -> None:
        open(self.marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    def _answer(self, rows: list[int]) -> Batch:
        return Batch(
            non_tensors={
                "row": rows,
                "response_ids": [[r, self.version] for r in rows],
                "rollout_logprobs": [[-0.5, -0.5] for _ in rows],
                "finish_reason": ["stop"] * len(rows),
                "token_versions": [[self.version] * 2 for _ in rows],
            }
        )


@pytest.fixture(scope="module")
def rm():
    with reserved(
        {"actor_infer": RoleSpec((0, 1), 2)}, num_gpus_per_node=2, ready_timeout_s=30
    ) as manager:
        yield manager


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "batch"])
def test_an_engine_killed_under_two_rollout_threads_is_replaced_once(rm, tmp_path, stream):
    """Two rollout threads send a batch each through both engines; rank 1 dies holding both
    (stream: both batches in its request stream; batch: one call running, one queued). It is
    replaced once (one restart, one restore, on the main thread while it waits for the
    threads, with the weights every engine then serves), both its shares are sent to the new
    engine (stream: submitted again first), and every request is answered once, with the
    restored weights."""
    cluster = Cluster("actor_infer", StreamEngine, rm, init_args=(str(tmp_path / "died"),))
    restores: list[tuple[str, list[int]]] = []

    def restore(c, ranks):  # what PolicySync.restore_engines does: weights into every engine
        restores.append((threading.current_thread().name, ranks))
        c.call("load", 7)

    broker = MainThreadRestore(restore)
    recovery = Recovery(max_restarts=2)
    recovery.watch(cluster, restore=broker)
    recovery.idle = broker.serve
    threads = ThreadPoolExecutor(2, "rollouts")
    try:
        cluster.initialize()
        cluster.load(3)
        pid = cluster.infos[1]["pid"]
        engines = RolloutEngines(cluster)

        def play(first_row: int):
            requests = [
                TurnRequest(context=[1, 2], n=1, seed=0, index=first_row + i, max_new_tokens=2)
                for i in range(4)
            ]
            samples, _ = engines.generate(requests, {"temperature": 1.0}, stream=stream)
            return samples, {}

        started = time.perf_counter()
        steps = [InFlight(s, 3, future=threads.submit(play, 10 * s)) for s in (1, 2)]
        outputs = [step.collect(timeout_s=60, idle=broker.serve) for step in steps]
        took = time.perf_counter() - started
    finally:
        broker.close()
        threads.shutdown(wait=False, cancel_futures=True)
        cluster.shutdown()
    print(f"\nreplaced a dead engine and redid both threads' requests in {took:.2f} s")
    assert restores == [(threading.main_thread().name, [1])]  # once, on the main thread
    assert recovery.restarts == {"actor_infer": 1}
    assert cluster.incarnations == [0, 1] and cluster.infos[1]["pid"] != pid
    for s, output in zip((1, 2), outputs, strict=True):
        samples = output["episodes"]
        assert [len(x) for x in samples] == [1, 1, 1, 1]  # every request answered once
        assert [x[0].ids[0] for x in samples] == [10 * s + i for i in range(4)]
        # rank 0's share was answered before the restore (version 3); rank 1's was redone
        # by the new engine after it (version 7)
        assert [x[0].ids[1] for x in samples] == [3, 3, 7, 7]
