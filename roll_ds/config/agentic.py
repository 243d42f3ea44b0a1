"""The agentic pipeline's config sections, named after ROLL's agentic pipeline where they mean
the same thing (a ROLL user recognises ``train_env_manager``, ``custom_envs``, ``tags``,
``group_size``, ``max_actions_per_traj``):

    custom_envs:                  # environment tags -> how to build them
      GuessNumber:
        env_type: guess_number    # a name in roll_ds.agentic.registry.ENVS
        max_actions_per_traj: 6   # turns per episode
        max_tokens_per_step: 16   # policy tokens per turn
        max_observation_tokens: 1024   # each reply message cut to this (null: no cap)
        env_config: {high: 16}    # the environment's keyword arguments
    train_env_manager:            # the episodes of one training step
      num_env_groups: 16          # GRPO groups (= rollout_batch_size)
      group_size: 8               # episodes per group, sharing one environment seed
      tags: [GuessNumber]
      num_groups_partition: null  # groups per tag (null: split evenly)
    val_env_manager:              # held-out episodes (seeds from val_seed_offset)
      num_env_groups: 64
      group_size: 1
      tags: [GuessNumber]
    agentic: {...}                # runner settings (AgenticConfig)

A step plays environment episodes when ``train_env_manager.tags`` is not empty:
``num_env_groups`` of its ``rollout_batch_size`` groups; the others are dataset rows
(``actor_train.data_args``), so a run may be all rows, all episodes, or both. Each episode's context
budget is ``prompt_length + response_length`` (the first observation, then every policy and
observation token after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

REWARD_MODES = ("trajectory", "per_turn")
TRUNCATION_SIDES = ("left", "right", "middle")  # roll_ds/agentic/truncation.py


@dataclass
class EnvSpecConfig:
    """One entry of ``custom_envs``.

    ``max_observation_tokens`` caps each message of the environment's reply to a turn (a tool's
    output, a tool error, the environment's text; not the first observation, the task) to that
    many tokens, a marker ``[... N characters truncated ...]`` where the rest was included; the
    episode records the cut text, what the model saw (roll_ds/agentic/truncation.py). Per
    environment because what a reply can hold depends on its tools (a calculator's number, a
    sandbox's stdout), like ``max_tokens_per_step`` for the policy's side. null: no cap (a tool
    answering 1 MB then costs a million tokens' tokenising and ends the episode at the context
    limit). ``observation_truncation_side``: the side cut, as in transformers'
    ``truncation_side``: left (keep the end), right (keep the start) or middle (keep both ends:
    the start of a tool's output and the end of a traceback)."""

    env_type: str = MISSING  # a name in roll_ds.agentic.registry.ENVS, or module:Class
    env_config: dict[str, Any] = field(default_factory=dict)  # the environment's kwargs
    max_actions_per_traj: int = 5  # turns per episode at most
    max_tokens_per_step: int = 32  # policy tokens per turn at most
    # Each reply message cut to this many tokens (not the first observation); null: no cap.
    max_observation_tokens: int | None = 1024
    observation_truncation_side: str = "middle"  # left | right | middle: the side cut


@dataclass
class EnvManagerConfig:
    num_env_groups: int = 0  # GRPO groups of episodes (training: of rollout_batch_size)
    # Episodes per group, sharing one environment seed (training: the GRPO group size).
    group_size: int = 1
    tags: list[str] = field(default_factory=list)  # custom_envs tags to play; empty: none
    num_groups_partition: list[int] | None = None  # groups per tag; null: split evenly
    # Kept for ROLL compatibility; not read: episodes spread over agentic.num_env_workers.
    max_env_num_per_worker: int = 256


@dataclass
class AgenticConfig:
    num_env_workers: int = 1  # environment worker actors (Ray), episodes spread over them
    step_timeout_s: float = 30.0  # an environment reset / step past it ends the episode
    error_reward: float = 0.0  # reward of an episode ended by an environment error / timeout
    # trajectory: every policy token of an episode gets its group-normalised return;
    # per_turn: turn t's tokens get the discounted return from turn t, normalised by its
    # group's episode returns (turn_gamma the discount)
    reward_mode: str = "trajectory"
    turn_gamma: float = 1.0  # per_turn: the discount across turns
    # Environment seeds: training groups' are drawn below val_seed_offset from (seed, step),
    # held-out group g's is val_seed_offset + g, so no held-out episode is ever trained on.
    val_seed_offset: int = 1_000_000


def has_environments(cfg: Any) -> bool:
    """Whether ``cfg`` (an ``RLVRConfig``) plays environment episodes in training."""
    return bool(cfg.train_env_manager.tags)


def row_groups(cfg: Any) -> int:
    """Dataset-row groups per step: ``rollout_batch_size`` less the environment groups."""
    envs = cfg.train_env_manager.num_env_groups if has_environments(cfg) else 0
    return cfg.rollout_batch_size - envs
