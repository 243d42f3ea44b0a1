"""Many episodes stepped together: one generate call per turn for every unfinished episode,
then every environment step of that turn at once. A dataset row is an episode of one turn.

    reset all (concurrently) -> prompt tokens (a row's: its tokenized prompt)
    loop: generate the next turn of all running episodes from their exact token sequences
          -> a row's episode ends (the reward roles score it afterwards)
          -> decode each environment turn -> step all environments -> observation tokens
          -> an episode ends when its environment says done, at max_actions_per_traj turns, when
             the next turn would not fit the context budget, or on an environment error/timeout

``generate(requests)`` is the rollout engines' call: token ids in, ``n`` samples (token ids and
their sampled log-probs) out per ``TurnRequest``. A row group's episodes share one request of
``n`` samples, seeded by the row's position in the draw; an environment episode's turn is a
request of one sample seeded by its episode id and its own turn. ``pool`` is an
``roll_ds/agentic/env_pool.py`` pool. Both are injected, so the loop runs the same on vLLM
workers, on a local engine, or in a unit test.

An episode whose environment host died (the pool answers ``lost``; its environment is gone with
the process) is played again from its start on the host's replacement: reset with the same
environment seed, then generated turn by turn again, its turn ``t`` seeded as before. Engines
that seed each request on its own (vLLM: ``(seed, index)``) sample the same tokens from the
same weights, so in the synchronous loop the redone episode is the one the dead host would
have given; it joins the others' turns where they are (a turn's requests of several seeds are
several engine calls). ``hf_infer`` draws a whole batch from one generator, so there a redo
samples afresh. An environment that raised is not redone: that is the environment's failure
(``env_error``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_ds.agentic.chat import ChatFormat
from roll_ds.agentic.env_pool import LOST, OK, TIMEOUT, EnvReply
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

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnRequest:
    """``n`` samples continuing ``context``; the engine seeds them from ``(seed, index)``."""

    context: list[int]
    n: int
    index: int
    seed: int
    max_new_tokens: int


@dataclass
class Sample:
    """One generated turn: its tokens, their sampled log-probs, why it stopped and (streamed
    generation) the policy version that sampled each token."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] | None = None


GenerateFn = Callable[[list[TurnRequest]], list[list[Sample]]]
ContextsFn = Callable[[list[list[int]], list[int], list[int], int], Mapping[str, list[Any]]]


def one_sample_each(generate: ContextsFn) -> GenerateFn:
    """A ``GenerateFn`` over a local engine that samples one continuation per context:
    ``generate(contexts, max_new_tokens, indices, seed)`` returning ``response_ids``,
    ``rollout_logprobs`` and (optionally) ``finish_reason`` lists (environment episodes only:
    every request has ``n`` 1; one call per seed: a turn's episodes share one, an episode
    played again from its start has its own turn's)."""

    def run(requests: list[TurnRequest]) -> list[list[Sample]]:
        if any(r.n != 1 for r in requests):
            raise ValueError("one_sample_each serves environment turns (n 1)")
        by_seed: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            by_seed.setdefault(request.seed, []).append(i)
        samples: list[list[Sample]] = [[] for _ in requests]
        for seed, positions in by_seed.items():
            out = generate(
                [requests[i].context for i in positions],
                [requests[i].max_new_tokens for i in positions],
                [requests[i].index for i in positions],
                seed,
            )
            reasons = out.get("finish_reason") or [""] * len(positions)
            for i, ids, lps, reason in zip(
                positions, out["response_ids"], out["rollout_logprobs"], reasons, strict=True
            ):
                samples[i] = [Sample(list(ids), list(lps), reason)]
        return samples

    return run


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
    """One episode to play: an environment's (``tag`` in the pool, reset with ``env_seed``), or
    a dataset row's (``prompt_ids`` given; ``tag`` is its domain, ``row`` the row, ``index`` its
    position in the draw, which seeds its group's request)."""

    episode_id: int
    group: int
    tag: str
    env_seed: int = -1
    prompt_ids: list[int] | None = field(default=None, repr=False)
    row: int = -1
    index: int = 0


def turn_seed(seed: int, turn: int) -> int:
    """The generation seed of an episode's turn ``turn`` (its request is seeded by its id
    too)."""
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
        row_max_new_tokens: int = 1,
    ) -> None:
        """``limits``: per environment tag; ``row_max_new_tokens``: a row's response limit."""
        self.tokenizer = tokenizer
        self.pool = pool
        self.generate = generate
        self.limits = dict(limits)
        self.max_context_tokens = max_context_tokens
        self.error_reward = error_reward
        self.row_max_new_tokens = row_max_new_tokens
        self._chats: dict[str, ChatFormat] = {}
        self._cutter = ObservationCutter(tokenizer)

    def chat_for(self, tools: Sequence[dict] | None) -> ChatFormat:
        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._chats:
            self._chats[key] = ChatFormat(self.tokenizer, tools)
        return self._chats[key]

    def run(
        self, specs: Sequence[EpisodeSpec], *, seed: int, row_seed: int | None = None
    ) -> tuple[list[Episode], dict]:
        """The episodes of ``specs``, played to the end; and timings (``generate_s``,
        ``env_s``: wall time of the generate calls and of the environment calls;
        ``redone``: episodes played again after their host died). An environment episode's
        turn ``t`` is seeded by ``turn_seed(seed, t)``, rows by ``row_seed`` (default
        ``seed``)."""
        episodes = [Episode(s.episode_id, s.group, s.tag, s.env_seed, row=s.row) for s in specs]
        spec_of = {id(e): s for e, s in zip(episodes, specs, strict=True)}
        timings = {"generate_s": 0.0, "env_s": 0.0, "turns": 0, "redone": 0}
        chats: dict[int, ChatFormat] = {}
        lost = self._reset(episodes, specs, chats, timings)
        row_seed = seed if row_seed is None else row_seed
        turn = 0
        while True:
            while lost:  # their host died: reset again on its replacement (module doc)
                logger.warning(
                    "episodes %s lost with their environment host (the run's turn %d): played "
                    "again from their start",
                    [e.episode_id for e in lost],
                    max(turn - 1, 0),  # the turn whose step (or the reset) found it dead
                )
                timings["redone"] += len(lost)
                lost = self._reset_envs(lost, chats, timings)
            active = [e for e in episodes if e.running]
            if not active:
                break
            requests, owners = self._requests(active, spec_of, seed=seed, row_seed=row_seed)
            started = time.perf_counter()
            outputs = self.generate(requests)
            timings["generate_s"] += time.perf_counter() - started
            acting: list[tuple[Episode, str]] = []
            for members, samples in zip(owners, outputs, strict=True):
                for episode, sample in zip(members, samples, strict=True):
                    chat = chats.get(episode.episode_id)
                    closed = chat is not None and bool(sample.ids) and sample.ids[-1] == chat.eos_id
                    episode.add_policy_turn(
                        list(sample.ids),
                        list(sample.logprobs),
                        closed=closed,
                        finish_reason=sample.finish_reason,
                        versions=sample.versions,
                    )
                    if episode.is_row:  # one turn; the reward roles score it
                        episode.end(DONE)
                    else:
                        acting.append((episode, chat.decode(sample.ids)))
            if acting:
                lost = self._step(acting, chats, timings)
            turn += 1
        envs = [e.episode_id for e in episodes if not e.is_row]
        if envs:
            self.pool.close(envs)
        timings["turns"] = turn
        return episodes, timings

    def _reset(
        self,
        episodes: list[Episode],
        specs: Sequence[EpisodeSpec],
        chats: dict[int, ChatFormat],
        timings: dict,
    ) -> list[Episode]:
        """Rows take their prompt; environments are reset (concurrently) and rendered. Returns
        the episodes whose host died meanwhile (to reset again)."""
        envs = []
        for episode, spec in zip(episodes, specs, strict=True):
            if spec.prompt_ids is not None:
                episode.prompt_ids = list(spec.prompt_ids)
            else:
                envs.append(episode)
        return self._reset_envs(envs, chats, timings) if envs else []

    def _reset_envs(
        self, envs: list[Episode], chats: dict[int, ChatFormat], timings: dict
    ) -> list[Episode]:
        """Reset ``envs``' environments and render their first observations into ``chats``;
        returns those lost with their host (restarted, to reset again)."""
        started = time.perf_counter()
        replies = self.pool.reset([(e.episode_id, e.tag, e.env_seed) for e in envs])
        timings["env_s"] += time.perf_counter() - started
        lost = []
        for episode, reply in zip(envs, replies, strict=True):
            if self._play_again(episode, reply):
                lost.append(episode)
                continue
            chat = chats[episode.episode_id] = self.chat_for(reply.tools)
            episode.env_seconds += reply.seconds
            if reply.status != OK:  # no task: an empty episode that trains nothing
                episode.prompt_ids = chat.prompt_ids([{"role": "user", "content": "-"}])
                episode.turn_rewards.append(self.error_reward)
                episode.end(_failure_status(reply))
                episode.record("", f"reset failed: {reply.error.strip()[-300:]}", 0.0)
                continue
            episode.first_observation = reply.observation
            episode.prompt_ids = chat.prompt_ids(reply.observation)
            if episode.context_length >= self.max_context_tokens:
                episode.turn_rewards.append(0.0)
                episode.end(CONTEXT_LIMIT)
        return lost

    def _play_again(self, episode: Episode, reply: EnvReply) -> bool:
        """Whether ``reply`` says the episode's host died and the episode starts over
        (``Episode.restart``). More redos than the pool has replacements would be a pool that
        keeps losing it: it ends as an environment error instead."""
        if reply.status != LOST or episode.redos >= self.pool.max_restarts:
            return False
        episode.restart()
        return True

    def _requests(
        self,
        active: list[Episode],
        spec_of: Mapping[int, EpisodeSpec],
        *,
        seed: int,
        row_seed: int,
    ) -> tuple[list[TurnRequest], list[list[Episode]]]:
        """This turn's requests and, for each, the episodes its samples go to (a row group's
        episodes share one request of ``n`` samples). An environment episode's request is
        seeded by its own turn, which is the loop's unless it was played again."""
        requests: list[TurnRequest] = []
        owners: list[list[Episode]] = []
        groups: dict[int, int] = {}  # a row group -> its request
        for episode in active:
            spec = spec_of[id(episode)]
            if not episode.is_row:
                requests.append(
                    TurnRequest(
                        episode.context_ids,
                        1,
                        episode.episode_id,
                        turn_seed(seed, episode.num_turns),
                        self._max_new_tokens(episode),
                    )
                )
                owners.append([episode])
            elif spec.group in groups:
                owners[groups[spec.group]].append(episode)
            else:
                groups[spec.group] = len(requests)
                requests.append(
                    TurnRequest(
                        list(spec.prompt_ids), 1, spec.index, row_seed, self.row_max_new_tokens
                    )
                )
                owners.append([episode])
        for i in groups.values():  # one sample per episode of the group
            requests[i] = TurnRequest(**{**requests[i].__dict__, "n": len(owners[i])})
        return requests, owners

    def _step(
        self, acting: list[tuple[Episode, str]], chats: dict[int, ChatFormat], timings: dict
    ) -> list[Episode]:
        """Step every acting episode's environment; returns those lost with their host
        (restarted, to reset again)."""
        started = time.perf_counter()
        replies = self.pool.step([(e.episode_id, action) for e, action in acting])
        timings["env_s"] += time.perf_counter() - started
        lost = []
        for (episode, action), reply in zip(acting, replies, strict=True):
            if self._play_again(episode, reply):
                lost.append(episode)
            else:
                self._after_step(episode, action, reply, chats[episode.episode_id])
        return lost

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
