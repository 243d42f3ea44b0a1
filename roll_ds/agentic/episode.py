"""One episode's tokens, masks and rewards, as the runner builds it turn by turn.

Every rollout is an episode: a dataset row's is one turn (its prompt the first observation, its
response the policy turn, scored afterwards by the reward roles; ``row`` says which row), an
environment's has as many turns as the environment plays.

    prompt_ids                        the first observation (chat template, generation prompt)
    token_ids   = turn 0's policy tokens + observation 0's tokens + turn 1's policy tokens ...
    policy_mask = 1 on policy tokens (what the loss trains), 0 on observation / tool tokens
    logprobs    = vLLM's sampled log-probs on policy tokens, 0 elsewhere
    turn_index  = the turn each token belongs to (observation tokens: the turn they answer)

``token_ids`` holds the policy's tokens exactly as generated and the observation tokens as
``ChatFormat.observation_ids`` made them; nothing is ever re-tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# How an episode ended
RUNNING = "running"
DONE = "done"  # the environment said done
MAX_TURNS = "max_turns"  # max_actions_per_traj turns taken
CONTEXT_LIMIT = "context_limit"  # the next turn would not fit max_context_tokens
ENV_ERROR = "env_error"  # reset / step raised, or the environment worker died
ENV_TIMEOUT = "env_timeout"  # reset / step took longer than step_timeout_s
STATUSES = (DONE, MAX_TURNS, CONTEXT_LIMIT, ENV_ERROR, ENV_TIMEOUT)


@dataclass
class Episode:
    """``group``: the GRPO group (episodes sharing ``env_seed`` in environment ``tag``)."""

    episode_id: int
    group: int
    tag: str
    env_seed: int
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)  # readable: action, observation
    # The first observation as the environment gave it (text or chat messages); rows: None.
    first_observation: Any = None
    status: str = RUNNING
    success: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    format_errors: int = 0
    truncated_observations: int = 0  # reply messages cut to max_observation_tokens
    env_seconds: float = 0.0
    last_turn_closed: bool = True  # the last policy turn ended with the end-of-turn token
    row: int = -1  # a dataset row's episode: the row (in the phase's train or held-out rows)
    finish_reason: str = ""  # the engine's, for the last policy turn: stop | length
    # The policy version that sampled each token (-1: an observation, or not recorded): under
    # async_generation.mode=stream a turn may span a weight sync.
    token_versions: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # a row's reward info (correct, ...)
    redos: int = 0  # times played again from the start (its environment host died: restart)

    @property
    def running(self) -> bool:
        return self.status == RUNNING

    @property
    def num_turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def context_length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def context_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.token_ids]

    @property
    def total_reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def is_row(self) -> bool:
        return self.row >= 0

    def add_policy_turn(
        self,
        ids: list[int],
        logprobs: list[float],
        *,
        closed: bool,
        finish_reason: str = "",
        versions: list[int] | None = None,
    ) -> None:
        """The policy's tokens of a new turn, as generated (``versions``: the policy version
        that sampled each)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} policy tokens but {len(logprobs)} log-probs")
        turn = len(self.turn_rewards)
        self.token_ids.extend(ids)
        self.policy_mask.extend([1] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.turn_index.extend([turn] * len(ids))
        self.token_versions.extend(versions if versions is not None else [-1] * len(ids))
        self.turn_rewards.append(0.0)
        self.last_turn_closed = closed
        self.finish_reason = finish_reason

    def add_reward(self, reward: float, info: dict[str, Any]) -> None:
        """The environment's answer to the last turn: its reward and counters."""
        self.turn_rewards[-1] += float(reward)
        self.success = self.success or bool(info.get("success", False))
        self.tool_calls += int(info.get("tool_calls", 0))
        self.tool_errors += int(bool(info.get("tool_error", False)))
        self.format_errors += int(bool(info.get("format_error", False)))

    def add_observation(self, ids: list[int]) -> None:
        """The environment's reply tokens (not trained on) after the last turn."""
        turn = max(len(self.turn_rewards) - 1, 0)
        self.token_ids.extend(ids)
        self.policy_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.turn_index.extend([turn] * len(ids))
        self.token_versions.extend([-1] * len(ids))

    def restart(self) -> None:
        """Back to before its reset, counting the redo: its environment host died, and the
        episode is played again from its start (``runner.py``). Who it is stays (id, group,
        tag, seed, row)."""
        redos = self.redos + 1
        kept = ("episode_id", "group", "tag", "env_seed", "row")
        fresh = Episode(**{name: getattr(self, name) for name in kept})
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))
        self.redos = redos

    def end(self, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown episode status {status!r}; valid: {', '.join(STATUSES)}")
        self.status = status

    def record(self, action: str, observation: str, reward: float) -> None:
        self.turns.append({"action": action, "observation": observation, "reward": reward})
