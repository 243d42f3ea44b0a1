"""The sync gate: turns played ahead in driver threads and a weight sync on the same engines.

``OrderedEngine`` stands at the boundary for a rollout actor under ``mode: stream``: it runs
calls one at a time in arrival order (as a Ray actor does), and a turn that arrives between
``pause`` and ``resume`` fails as the real request stream does (a blocking call cannot finish
while generation is paused)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from roll_ds.pipeline.sync_gate import SyncGate


class OrderedEngine:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # one call at a time, like an actor's queue
        self.paused = False
        self.version = 0
        self.log: list[tuple[str, int]] = []

    def turn(self, episode: int) -> int:
        with self._lock:
            if self.paused:
                raise RuntimeError("generation batch cannot finish while generation is paused")
            time.sleep(0.002)  # a few decode steps
            self.log.append(("turn", episode))
            return self.version

    def pause(self) -> None:
        with self._lock:
            self.paused = True
            self.log.append(("pause", self.version))

    def receive_and_resume(self, version: int) -> None:
        with self._lock:
            time.sleep(0.01)  # the transfer
            self.version, self.paused = version, False
            self.log.append(("resume", version))


def _play(engine: OrderedEngine, gate: SyncGate | None, episode: int, turns: int) -> list[int]:
    versions = []
    for _ in range(turns):
        if gate is None:
            versions.append(engine.turn(episode))
        else:
            with gate.call():
                versions.append(engine.turn(episode))
    return versions


def _syncs(engine: OrderedEngine, gate: SyncGate | None, count: int) -> None:
    for version in range(1, count + 1):
        time.sleep(0.005)
        if gate is None:
            engine.pause()
            time.sleep(0.005)  # the driver between its pause and its transfer calls
            engine.receive_and_resume(version)
        else:
            with gate.sync():
                engine.pause()
                time.sleep(0.005)
                engine.receive_and_resume(version)


def _run(gate: SyncGate | None) -> list[list[int]]:
    engine = OrderedEngine()
    with ThreadPoolExecutor(4) as pool:
        episodes = [pool.submit(_play, engine, gate, e, 40) for e in range(3)]
        syncer = pool.submit(_syncs, engine, gate, 5)
        syncer.result()
        return [e.result() for e in episodes]


def test_without_the_gate_a_turn_lands_inside_a_sync_and_fails():
    with pytest.raises(RuntimeError, match="while generation is paused"):
        _run(None)


def test_with_the_gate_turns_wait_for_the_resume_and_episodes_span_syncs():
    versions = _run(SyncGate())
    for episode in versions:
        assert len(episode) == 40
        assert episode == sorted(episode)  # each turn used the newest weights at its time
    assert any(len(set(e)) > 1 for e in versions)  # episodes went on across syncs


def test_a_waiting_sync_goes_before_new_calls():
    gate = SyncGate()
    order: list[str] = []
    in_call = threading.Event()
    release = threading.Event()

    def long_call() -> None:
        with gate.call():
            in_call.set()
            release.wait(5)
            order.append("first call")

    def sync() -> None:
        with gate.sync():
            order.append("sync")

    def late_call() -> None:
        with gate.call():
            order.append("late call")

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(long_call)
        in_call.wait(5)
        syncing = pool.submit(sync)
        time.sleep(0.05)  # the sync is waiting for the call in flight
        late = pool.submit(late_call)
        time.sleep(0.05)
        assert order == [] and gate.calls_in_flight == 1
        release.set()
        for f in (first, syncing, late):
            f.result(5)
    assert order == ["first call", "sync", "late call"]


# --- the pipeline's own sync and turn calls over the same ordered engine ----------------------


class _Pending:
    def __init__(self, value) -> None:
        self.value = value

    def get(self, timeout_s=None):
        return self.value


class EngineCluster:
    """``actor_infer`` as the sync phase and the episode phase call it (the Ray boundary)."""

    name = "actor_infer"

    def __init__(self, engine: OrderedEngine) -> None:
        self.engine = engine

    def call(self, method: str, *args):
        if method == "pause_generation":
            return self.engine.pause()
        if method == "resume_generation":
            return self.engine.receive_and_resume(args[0])
        raise AssertionError(method)

    def submit(self, method: str, batch, **kwargs):
        assert method == "generate_turns"
        from roll_ds.distributed.batch import Batch

        rows = list(batch["row"])
        version = self.engine.turn(rows[0])
        return _Pending(
            Batch(
                non_tensors={
                    "row": rows,
                    "response_ids": [[version]] * len(rows),
                    "rollout_logprobs": [[-0.5]] * len(rows),
                    "finish_reason": ["length"] * len(rows),
                }
            )
        )


class NoTransfer:
    """The transport: the transfer itself is the engine's receive, timed in resume."""

    def sync(self, sender, receiver) -> dict[str, float]:
        time.sleep(0.005)  # the trainer's gather between the pause and the resume
        return {"sync/seconds": 0.0}


def test_pipeline_turns_sent_during_a_stream_sync_wait_for_its_resume():
    """``PolicySync`` (``mode: stream``) and ``EpisodePhase``'s turn calls share the gate the
    agentic pipeline gives them: turns from threads playing ahead never reach the engine
    between its pause and its resume (on today's main they did, and the step failed)."""
    from roll_ds.config import load_config
    from roll_ds.pipeline.colocation import Choreography, ColocationPlan
    from roll_ds.pipeline.episode_phase import EpisodePhase
    from roll_ds.pipeline.policy_sync import PolicySync

    cfg = load_config(
        "agentic_lora_zero3",
        [
            "async_generation.max_staleness=2",
            "async_generation.mode=stream",
            "weight_sync.parity_check=false",
        ],
        check_files=False,
    )
    engine = OrderedEngine()
    clusters = {"actor_infer": EngineCluster(engine), "actor_train": object()}
    colocation = Choreography(ColocationPlan())
    sync = PolicySync(cfg, clusters, colocation, train_rows=[], pad_id=0)
    sync.transport = NoTransfer()
    phase = EpisodePhase(
        cfg=cfg,
        clusters=clusters,
        colocation=colocation,
        tokenizer=None,
        pool=None,
        pad_id=0,
        gate=sync.gate,
    )

    def play(episode: int) -> list[int]:
        return [
            phase._generate([[1, 2]], [4], [episode], seed=t, sampling={})["response_ids"][0][0]
            for t in range(30)
        ]

    with ThreadPoolExecutor(4) as pool:
        episodes = [pool.submit(play, e) for e in range(3)]
        for version in range(1, 6):
            time.sleep(0.005)
            sync.sync(version)
        versions = [e.result() for e in episodes]
    assert all(v == sorted(v) for v in versions)
    assert engine.log.count(("resume", 5)) == 1
