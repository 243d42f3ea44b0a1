"""The async rollout queue: steps played ahead in threads, taken in order, staleness, and the
checkpoint round trip of the episodes in flight (rows and environment episodes alike)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from roll_ds.agentic.episode import DONE, Episode
from roll_ds.pipeline.rollout_queue import STATE_FILE, InFlight, RolloutQueue


def _play(step: int, versions: list[int] | None = None) -> tuple[list[Episode], dict]:
    """A row episode and an environment episode of step ``step``."""
    row = Episode(-1, 0, "math", -1, row=step)
    row.prompt_ids = [1, 2]
    row.add_policy_turn(
        [5, 6], [-0.125, -1.0 / 3.0], closed=True, finish_reason="stop", versions=versions
    )
    row.turn_rewards[-1] = 1.0
    row.info = {"correct": True}
    row.end(DONE)
    env = Episode(step * 10, 1, "GuessNumber", env_seed=step)
    env.prompt_ids = [1, 2]
    env.add_policy_turn([5], [-2.5e-7], closed=True, finish_reason="stop")
    env.add_reward(1.0, {"success": True})
    env.record("guess 4", "correct", 1.0)
    env.add_observation([9, 9])
    env.end(DONE)
    return [row, env], {"generate_s": 0.5, "env_s": 0.25, "turns": 1}


class _Submitter:
    def __init__(self, version: list[int], versions: list[int] | None = None) -> None:
        self.version, self.versions, self.submitted = version, versions, []
        self.threads = ThreadPoolExecutor(2)

    def __call__(self, step: int) -> InFlight:
        self.submitted.append(step)
        future = self.threads.submit(_play, step, self.versions)
        return InFlight(step, self.version[0], future=future)


def test_steps_are_submitted_ahead_and_taken_in_order():
    queue, version = RolloutQueue(depth=2), [0]
    submit = _Submitter(version)
    queue.fill(0, submit)  # the start: steps 0, 1, 2 with the initial weights
    assert submit.submitted == [0, 1, 2]
    item = queue.take(0)
    assert (item.step, item.version, item.output["episodes"][0].row) == (0, 0, 0)
    version[0] = 1  # the engines got the weights after step 0
    queue.fill(1, submit)
    assert submit.submitted == [0, 1, 2, 3]  # only step 3 is new, played by version 1
    assert [(i.step, i.version) for i in queue.items] == [(1, 0), (2, 0), (3, 1)]
    # Step 3 trains with policy version 3 on version-1 episodes: staleness 2 = max_staleness.
    with pytest.raises(RuntimeError, match="step 5 is not next in flight"):
        queue.take(5)


def test_a_batch_mode_sync_waits_for_every_step_in_flight():
    """At max_staleness 2 an engine may still be generating two steps when one ends; the sync
    waits for both (each step keeps the weights it started with, and no generate call waits on
    an engine while the trainer's side of the transfer does)."""
    queue = RolloutQueue(depth=2)
    queue.fill(0, _Submitter([0]))
    queue.take(0)
    queue.wait_for_sync()
    assert [i.step for i in queue.items] == [1, 2]
    assert all(i.output is not None and i.future is None for i in queue.items)


def test_checkpoint_round_trip_is_exact_json(tmp_path):
    queue = RolloutQueue(depth=1)
    queue.fill(4, _Submitter([3], versions=[2, 3]))
    queue.take(4)
    queue.save(tmp_path)  # waits for step 5 and stores it
    json.loads((tmp_path / STATE_FILE).read_text())  # plain JSON, no pickle
    restored = RolloutQueue(depth=1)
    restored.load(tmp_path)
    [item] = restored.items
    original = queue.items[0]
    assert (item.step, item.version) == (5, 3)
    assert item.output == original.output  # every token, log-prob bit for bit, version, turn
    assert item.output["episodes"][0].token_versions == [2, 3]
    assert item.future is None
    submit = _Submitter([5])
    restored.fill(5, submit)  # the next fill continues after the restored step
    assert submit.submitted == [6]


def test_a_checkpoint_in_the_older_format_is_refused_naming_the_way_out(tmp_path):
    (tmp_path / "rollouts_in_flight.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"async_generation\.max_staleness=0"):
        RolloutQueue(depth=1).load(tmp_path)


def test_no_state_file_means_an_empty_queue(tmp_path):
    queue = RolloutQueue(depth=1)
    queue.fill(0, _Submitter([0]))
    queue.load(tmp_path)
    assert not queue.items and queue.next_step is None


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutQueue(depth=0)


def test_fill_stops_short_of_max_steps():
    queue, submit = RolloutQueue(depth=2), _Submitter([3])
    queue.fill(3, submit, stop=5)  # a 5-step run: steps 3 and 4 only
    assert submit.submitted == [3, 4]
    queue.take(3)
    queue.fill(4, submit, stop=5)
    assert submit.submitted == [3, 4]  # nothing trains on a step-5 rollout


def test_streamed_tokens_report_per_token_staleness():
    """Tokens labelled with the version that sampled them (observations and unlabelled tokens
    carry -1 and do not count)."""
    queue = RolloutQueue(depth=2)
    queue.fill(4, _Submitter([2], versions=[2, 3]), stop=6)
    item = queue.take(4)
    # tokens of versions 2 and 3 trained at step 4: at most 2 versions old, 1.5 on average
    assert item.staleness(4) == (2.0, 1.5)


def test_batch_mode_staleness_is_the_submitting_version():
    item = InFlight(7, 5, future=ThreadPoolExecutor(1).submit(_play, 7))
    item.collect()
    assert item.staleness(7) == (2.0, 2.0)


def test_a_wait_for_the_rollout_threads_serves_them_meanwhile():
    """``idle`` runs while the main thread waits for a step (a rollout thread may be waiting
    for it: an engine's restore), and a step that never ends still times out."""
    import threading
    from concurrent.futures import Future

    served = threading.Event()
    queue = RolloutQueue(depth=1, idle=served.set)
    blocked: Future = Future()
    threads = ThreadPoolExecutor(1)
    # the step's thread finishes only once the waiting thread served it
    future = threads.submit(lambda: (served.wait(5), _play(0))[1])
    queue.items.append(InFlight(0, 0, future=future))
    assert queue.take(0).output["episodes"][0].row == 0
    queue.items.append(InFlight(1, 0, future=blocked))
    with pytest.raises(TimeoutError):
        queue.wait_all(timeout_s=0.2)
