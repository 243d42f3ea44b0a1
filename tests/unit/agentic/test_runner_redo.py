"""Episodes whose environment host died are played again from their start: the same environment
seeds and generation seeds give the episodes an uninterrupted run gives. The pool's loss is
simulated at its boundary (``Losing``: a ``LocalEnvPool`` that drops some episodes' environments
at a chosen call and answers ``lost`` for them, as ``RayEnvPool`` does for a dead host); the
generate function samples from ``(seed, index, context)`` alone, as vLLM's per-request seeds
do. The real host death on Ray: ``tests/integration/test_env_pool_ray.py``."""

from __future__ import annotations

import random
import zlib

import pytest
from transformers import AutoTokenizer

from roll_ds.agentic.env_pool import LOST, EnvReply, EnvTypeSpec, LocalEnvPool
from roll_ds.agentic.episode import ENV_ERROR, Episode
from roll_ds.agentic.runner import (
    EpisodeRunner,
    EpisodeSpec,
    TurnLimits,
    one_sample_each,
    turn_seed,
)
from roll_ds.models.shipped import EMBEDDED_MODEL, resolve_embedded

GUESS = {"guess": EnvTypeSpec("guess_number", {"low": 1, "high": 16})}
SPECS = [EpisodeSpec(i, i // 2, "guess", 200 + i // 2) for i in range(8)]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(resolve_embedded(EMBEDDED_MODEL))
    tok.chat_template = (
        "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] }}"
        "<|im_end|>{%- else -%}<|im_start|>{{ m['content'] }}<|im_end|>{%- endif -%}"
        "{%- endfor -%}"
    )
    return tok


class SeededPolicy:
    """Guesses a number drawn from ``(seed, index, context)`` only (what a per-request seeded
    engine depends on); records each call's seed and indices."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, contexts, max_new_tokens, indices, seed):
        self.calls.append((seed, list(indices)))
        ids, lps = [], []
        for context, index in zip(contexts, indices, strict=True):
            key = zlib.crc32(str((seed, index, context)).encode())
            guess = random.Random(key).randint(1, 16)
            out = self.tok(str(guess), add_special_tokens=False)["input_ids"]
            out = [*out, self.tok.eos_token_id]
            ids.append(out)
            lps.append([-(key % 97) / 100.0] * len(out))
        return {"response_ids": ids, "rollout_logprobs": lps}


class Losing(LocalEnvPool):
    """A pool whose "host" dies in reset or step call ``at`` (counted over both): the episodes
    in ``victims`` that call carries lose their environments and come back ``lost``."""

    def __init__(self, *, method: str, at: int, victims: set[int], max_restarts: int = 1):
        super().__init__(GUESS, 5.0)
        self.method, self.at, self.victims = method, at, victims
        self.max_restarts = max_restarts
        self.calls = {"reset": 0, "step": 0}

    def _lose(self, method: str, items, replies):
        self.calls[method] += 1
        if method != self.method or self.calls[method] != self.at:
            return replies
        for i, item in enumerate(items):
            if item[0] in self.victims:
                self.host.envs.pop(item[0], None)
                replies[i] = EnvReply(status=LOST, error="environment host 0 died: SIGKILL")
        return replies

    def reset(self, items):
        return self._lose("reset", items, super().reset(items))

    def step(self, items):
        return self._lose("step", items, super().step(items))


def play(tokenizer, pool, policy=None):
    policy = policy or SeededPolicy(tokenizer)
    runner = EpisodeRunner(
        tokenizer=tokenizer,
        pool=pool,
        generate=one_sample_each(policy),
        limits={"guess": TurnLimits(5, 8)},
        max_context_tokens=200,
        error_reward=-1.0,
    )
    episodes, timings = runner.run(SPECS, seed=11)
    return episodes, timings, policy


def played(episode: Episode) -> dict:
    """What training and the metrics read of an episode (not its timings)."""
    keep = ("prompt_ids", "token_ids", "policy_mask", "logprobs", "turn_index", "turn_rewards")
    return {
        **{k: getattr(episode, k) for k in keep},
        "turns": episode.turns,
        "status": episode.status,
        "success": episode.success,
        "format_errors": episode.format_errors,
    }


@pytest.mark.parametrize(("method", "at"), [("step", 2), ("reset", 1)])
def test_episodes_lost_with_their_host_are_played_again_and_equal_an_uninterrupted_run(
    tokenizer, method, at
):
    want, _, _ = play(tokenizer, LocalEnvPool(GUESS, 5.0))
    assert max(e.num_turns for e in want) > 2  # the loss lands mid-episode
    victims = {0, 2, 4, 6}  # the even ids: host 0 of two
    got, timings, policy = play(tokenizer, Losing(method=method, at=at, victims=victims))
    assert [played(e) for e in got] == [played(e) for e in want]
    assert timings["redone"] == len(victims)
    assert [e.redos for e in got] == [int(e.episode_id in victims) for e in got]
    if method == "step":  # the redone episodes asked for their turn 0 again, seeded as before
        again = [(s, rows) for s, rows in policy.calls if s == turn_seed(11, 0)]
        assert len(again) == 2 and sorted(again[1][1]) == sorted(victims)


def test_an_episode_lost_more_often_than_the_pool_replaces_hosts_ends_as_an_env_error(tokenizer):
    got, timings, _ = play(tokenizer, Losing(method="step", at=1, victims={3}, max_restarts=0))
    lost = got[3]
    assert lost.status == ENV_ERROR and lost.total_reward == -1.0 and lost.redos == 0
    assert "died" in lost.turns[-1]["observation"]
    assert timings["redone"] == 0


def test_restart_keeps_who_the_episode_is_and_counts_the_redo():
    episode = Episode(7, 3, "guess", 42, row=-1)
    episode.prompt_ids = [1, 2]
    episode.add_policy_turn([5, 6], [-0.1, -0.2], closed=True)
    episode.add_reward(1.0, {"success": True, "tool_calls": 2})
    episode.record("8", "correct", 1.0)
    episode.end("done")
    episode.restart()
    assert (episode.episode_id, episode.group, episode.tag, episode.env_seed) == (7, 3, "guess", 42)
    assert episode.running and episode.redos == 1 and not episode.success
    assert episode.token_ids == [] and episode.turns == [] and episode.tool_calls == 0
    assert episode.prompt_ids == [] and episode.num_turns == 0
