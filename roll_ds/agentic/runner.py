"""Many episodes stepped together: one generate call per turn for every unfinished episode,
then every environment step of that turn at once.

    reset all (concurrently) -> prompt tokens
    loop: generate the next turn of all running episodes from their exact token sequences
          -> decode each turn -> step all environments -> observation tokens appended
          -> an episode ends when its environment says done, at max_actions_per_traj turns, when
             the next turn would not fit the context budget, or on an environment error/timeout

``generate(contexts, max_new_tokens, row_ids, seed)`` is the rollout engines' call (token ids
in, token ids and sampled log-probs out, one sample per context); ``pool`` is an
``roll_ds/agentic/env_pool.py`` pool. Both are injected, so the loop runs the same on vLLM
workers, on a local engine, or in a unit test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roll_ds.agentic.chat import ChatFormat
from roll_ds.agentic.env_pool import OK, TIMEOUT, EnvReply
from roll_ds.agentic.episode import (
    CONTEXT_LIMIT,
    DONE,
    ENV_ERROR,
    ENV_TIMEOUT,
    MAX_TURNS,
    STATUSES,
    Episode,
)
from roll_ds.agentic.truncation import ObservationCutter
from roll_ds.config.agentic import EnvSpecConfig

GenerateFn = Callable[[list[list[int]], list[int], list[int], int], Mapping[str, list[Any]]]


@dataclass(frozen=True)
class TurnLimits:
    """One environment tag's limits: turns per episode, policy tokens per turn, and the tokens
    kept of each message the environment replies with (None: all) and the side cut."""

    max_turns: int
    max_tokens_per_turn: int
    max_observation_tokens: int | None = None
    truncation_side: str = "middle"

    @classmethod
    def of(cls, spec: EnvSpecConfig) -> TurnLimits:
        """The limits a ``custom_envs`` entry sets."""
        return cls(
            spec.max_actions_per_traj,
            spec.max_tokens_per_step,
            spec.max_observation_tokens,
            spec.observation_truncation_side,
        )


@dataclass
class EpisodeSpec:
    episode_id: int
    group: int
    tag: str
    env_seed: int


def turn_seed(seed: int, turn: int) -> int:
    """The generation seed of turn ``turn`` (each episode's request is seeded by its row too)."""
    return (seed * 1_000_003 + turn * 7919) & 0x7FFFFFFF


class EpisodeRunner:
    """Runs batches of episodes; ``chat_for(tools)`` makes the chat format for a tool set."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        pool: Any,
        generate: GenerateFn,
        limits: Mapping[str, TurnLimits],
        max_context_tokens: int,
        error_reward: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.generate = generate
        self.limits = dict(limits)
        self.max_context_tokens = max_context_tokens
        self.error_reward = error_reward
        self._chats: dict[str, ChatFormat] = {}
        self._cutter = ObservationCutter(tokenizer)

    def chat_for(self, tools: Sequence[dict] | None) -> ChatFormat:
        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._chats:
            self._chats[key] = ChatFormat(self.tokenizer, tools)
        return self._chats[key]

    def run(self, specs: Sequence[EpisodeSpec], *, seed: int) -> tuple[list[Episode], dict]:
        """The episodes of ``specs``, played to the end; and timings (``generate_s``,
        ``env_s``: wall time of the generate calls and of the environment calls)."""
        episodes = [Episode(s.episode_id, s.group, s.tag, s.env_seed) for s in specs]
        chats: dict[int, ChatFormat] = {}
        timings = {"generate_s": 0.0, "env_s": 0.0, "turns": 0}
        started = time.perf_counter()
        replies = self.pool.reset([(e.episode_id, e.tag, e.env_seed) for e in episodes])
        timings["env_s"] += time.perf_counter() - started
        for episode, reply in zip(episodes, replies, strict=True):
            chat = chats[episode.episode_id] = self.chat_for(reply.tools)
            episode.env_seconds += reply.seconds
            if reply.status != OK:  # no task: an empty episode that trains nothing
                episode.prompt_ids = chat.prompt_ids([{"role": "user", "content": "-"}])
                episode.turn_rewards.append(self.error_reward)
                episode.end(_failure_status(reply))
                episode.record("", f"reset failed: {reply.error.strip()[-300:]}", 0.0)
                continue
            episode.prompt_ids = chat.prompt_ids(reply.observation)
            if episode.context_length >= self.max_context_tokens:
                episode.turn_rewards.append(0.0)
                episode.end(CONTEXT_LIMIT)
        turn = 0
        while True:
            active = [e for e in episodes if e.running]
            if not active:
                break
            started = time.perf_counter()
            out = self.generate(
                [e.context_ids for e in active],
                [self._max_new_tokens(e) for e in active],
                [e.episode_id for e in active],
                turn_seed(seed, turn),
            )
            timings["generate_s"] += time.perf_counter() - started
            actions = []
            for i, episode in enumerate(active):
                ids = list(out["response_ids"][i])
                chat = chats[episode.episode_id]
                closed = bool(ids) and ids[-1] == chat.eos_id
                episode.add_policy_turn(ids, list(out["rollout_logprobs"][i]), closed=closed)
                actions.append(chat.decode(ids))
            started = time.perf_counter()
            replies = self.pool.step(
                [(e.episode_id, a) for e, a in zip(active, actions, strict=True)]
            )
            timings["env_s"] += time.perf_counter() - started
            for episode, action, reply in zip(active, actions, replies, strict=True):
                self._after_step(episode, action, reply, chats[episode.episode_id])
            turn += 1
        self.pool.close([e.episode_id for e in episodes])
        timings["turns"] = turn
        return episodes, timings

    def _max_new_tokens(self, episode: Episode) -> int:
        room = self.max_context_tokens - episode.context_length
        return max(1, min(self.limits[episode.tag].max_tokens_per_turn, room))

    def _after_step(self, episode: Episode, action: str, reply: EnvReply, chat: ChatFormat) -> None:
        episode.env_seconds += reply.seconds
        if reply.status != OK:
            episode.add_reward(self.error_reward, {})
            episode.end(_failure_status(reply))
            episode.record(action, f"[{reply.status}] {reply.error.strip()[-300:]}", 0.0)
            return
        episode.add_reward(reply.reward, reply.info)
        limits = self.limits[episode.tag]  # the reply cut to what the model sees, and recorded
        observation, cut = self._cutter.cut_messages(
            reply.observation, limits.max_observation_tokens, limits.truncation_side
        )
        episode.truncated_observations += cut
        text = "\n".join(m["content"] for m in observation)
        episode.record(action, text, reply.reward)
        if reply.done:
            episode.end(DONE)
        elif episode.num_turns >= limits.max_turns:
            episode.end(MAX_TURNS)
        else:
            ids = chat.observation_ids(observation, closed=episode.last_turn_closed)
            if episode.context_length + len(ids) >= self.max_context_tokens:
                episode.end(CONTEXT_LIMIT)  # no room for the observation and a next turn
            else:
                episode.add_observation(ids)


def _failure_status(reply: EnvReply) -> str:
    return ENV_TIMEOUT if reply.status == TIMEOUT else ENV_ERROR


def episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """``<prefix>/success`` (and per environment tag), turns, tool calls, tool / format errors,
    tokens per turn, environment time per step, and the share of each end status;
    ``env/errors`` / ``env/timeouts`` count failed environment calls."""
    if not episodes:
        return {}
    n = len(episodes)
    turns = sum(e.num_turns for e in episodes)
    policy_tokens = sum(sum(e.policy_mask) for e in episodes)
    metrics = {
        f"{prefix}/success": sum(e.success for e in episodes) / n,
        f"{prefix}/return": sum(e.total_reward for e in episodes) / n,
        f"{prefix}/turns_per_episode": turns / n,
        f"{prefix}/tool_calls": sum(e.tool_calls for e in episodes) / n,
        f"{prefix}/tool_errors": sum(e.tool_errors for e in episodes) / n,
        f"{prefix}/format_errors": sum(e.format_errors for e in episodes) / n,
        f"{prefix}/truncated_observations": sum(e.truncated_observations for e in episodes) / n,
        f"{prefix}/tokens_per_turn": policy_tokens / max(turns, 1),
        f"{prefix}/env_seconds_per_step": sum(e.env_seconds for e in episodes) / max(turns, 1),
    }
    for status in STATUSES:
        metrics[f"{prefix}/end_{status}"] = sum(e.status == status for e in episodes) / n
    for tag in sorted({e.tag for e in episodes}):
        mine = [e for e in episodes if e.tag == tag]
        metrics[f"{prefix}/{tag}/success"] = sum(e.success for e in mine) / len(mine)
    if prefix == "rollout":
        metrics["env/errors"] = float(sum(e.status == ENV_ERROR for e in episodes))
        metrics["env/timeouts"] = float(sum(e.status == ENV_TIMEOUT for e in episodes))
    return metrics
