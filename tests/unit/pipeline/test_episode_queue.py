"""The agentic episode queue: steps played ahead in threads, taken in order, stored exactly."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from roll_ds.agentic.episode import DONE, Episode
from roll_ds.pipeline.episode_queue import STATE_FILE, EpisodeQueue, EpisodesInFlight


def _play(step: int) -> tuple[list[Episode], dict]:
    episode = Episode(step * 10, 0, "GuessNumber", env_seed=step)
    episode.prompt_ids = [1, 2]
    episode.add_policy_turn([5, 6], [-0.1, -1.0 / 3.0], closed=True)
    episode.add_reward(1.0, {"success": True})
    episode.record("guess 4", "correct", 1.0)
    episode.end(DONE)
    return [episode], {"generate_s": 0.5, "env_s": 0.25, "turns": 1}


def test_played_ahead_taken_in_order_and_round_tripped(tmp_path):
    threads = ThreadPoolExecutor(2)
    queue = EpisodeQueue(depth=1)

    def submit(step: int) -> EpisodesInFlight:
        return EpisodesInFlight(step, version=step, future=threads.submit(_play, step))

    queue.fill(0, submit, stop=3)
    assert [i.step for i in queue.items] == [0, 1]
    taken = queue.take(0)
    assert taken.output["episodes"][0].episode_id == 0
    assert taken.staleness(0) == (0.0, 0.0)
    queue.save(tmp_path)  # waits for step 1 and stores it
    assert (tmp_path / STATE_FILE).is_file()
    restored = EpisodeQueue(depth=1)
    restored.load(tmp_path)
    [item] = restored.items
    assert (item.step, item.version) == (1, 1)
    assert item.output == queue.items[0].output  # every token, log-prob, reward and turn
    assert item.staleness(2) == (1.0, 1.0)
    threads.shutdown()
