"""Checks of the agentic sections (``custom_envs``, ``train_env_manager``, ``val_env_manager``,
``agentic``) before anything starts; each problem names the field and the fix. Imports only
registries (no torch, Ray or vLLM)."""

from __future__ import annotations

from typing import Any

from roll_ds.agentic.registry import TOOL_PARSERS, TOOLS, env_type_problem
from roll_ds.config.agentic import (
    REWARD_MODES,
    TRUNCATION_SIDES,
    EnvManagerConfig,
    has_environments,
    row_groups,
)
from roll_ds.config.ranges import SEED_MAX
from roll_ds.config.strategies import STRATEGY_SPECS

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def agentic_problems(cfg: Any) -> list[str]:
    """The agentic sections of a run that plays environment episodes: in training
    (``train_env_manager.tags``), or only in evaluation (``val_env_manager.tags``, played by the
    pipeline's evaluation and by ``roll_ds evaluate``)."""
    if not has_environments(cfg):
        return held_out_only_problems(cfg) if cfg.val_env_manager.tags else []
    problems: list[str] = []
    for name, spec in cfg.custom_envs.items():
        problems += _env_problems(f"custom_envs.{name}", spec, cfg)
    problems += _manager_problems("train_env_manager", cfg.train_env_manager, cfg)
    if cfg.eval_steps > 0:
        if not cfg.val_env_manager.tags:
            problems.append(
                f"val_env_manager.tags: eval_steps={cfg.eval_steps} evaluates held-out "
                "episodes but no environment tag is listed; list tags or set eval_steps=0"
            )
        problems += _manager_problems("val_env_manager", cfg.val_env_manager, cfg)
    train = cfg.train_env_manager
    if train.num_env_groups > cfg.rollout_batch_size:
        problems.append(
            f"train_env_manager.num_env_groups: {train.num_env_groups} of rollout_batch_size "
            f"{cfg.rollout_batch_size} groups per step; raise rollout_batch_size (all episodes: "
            "rollout_batch_size: ${train_env_manager.num_env_groups})"
        )
    elif row_groups(cfg) > 0 and not cfg.actor_train.data_args.file_name:
        problems.append(
            f"rollout_batch_size: {cfg.rollout_batch_size} groups per step, "
            f"train_env_manager.num_env_groups {train.num_env_groups} of them environment "
            f"episodes: the other {row_groups(cfg)} are dataset rows, but "
            "actor_train.data_args.file_name lists no data; list files, or set "
            "rollout_batch_size: ${train_env_manager.num_env_groups}"
        )
    if train.group_size != cfg.num_return_sequences_in_group:
        problems.append(
            f"train_env_manager.group_size: {train.group_size} but num_return_sequences_in_group "
            f"is {cfg.num_return_sequences_in_group}; set num_return_sequences_in_group: "
            "${train_env_manager.group_size}"
        )
    problems += _runner_problems(cfg)
    return problems


def _env_problems(where: str, spec: Any, cfg: Any) -> list[str]:
    problems = []
    problem = env_type_problem(spec.env_type)
    if problem:
        problems.append(f"{where}.env_type: {problem}")
    if spec.max_actions_per_traj < 1:
        problems.append(
            f"{where}.max_actions_per_traj: {spec.max_actions_per_traj}; an episode needs at "
            "least one turn (>= 1)"
        )
    if spec.max_tokens_per_step < 1:
        problems.append(f"{where}.max_tokens_per_step: {spec.max_tokens_per_step}; must be >= 1")
    elif spec.max_tokens_per_step > cfg.response_length:
        problems.append(
            f"{where}.max_tokens_per_step: {spec.max_tokens_per_step} is more than the whole "
            f"episode budget after the first observation (response_length "
            f"{cfg.response_length}); raise response_length or lower max_tokens_per_step"
        )
    cap = spec.max_observation_tokens
    if cap is not None and cap < 1:
        problems.append(
            f"{where}.max_observation_tokens: {cap}; must be >= 1 (tokens kept of each reply "
            "message), or null for no cap"
        )
    if spec.observation_truncation_side not in TRUNCATION_SIDES:
        problems.append(
            f"{where}.observation_truncation_side: {spec.observation_truncation_side!r}; valid: "
            f"{', '.join(TRUNCATION_SIDES)} (the side cut)"
        )
    parser = spec.env_config.get("parser")
    if parser is not None and parser not in TOOL_PARSERS:
        problems.append(f"{where}.env_config.parser: {TOOL_PARSERS.unknown_message(parser)}")
    for tool in spec.env_config.get("tools", None) or []:
        if tool not in TOOLS:
            problems.append(f"{where}.env_config.tools: {TOOLS.unknown_message(tool)}")
    return problems


def _manager_problems(where: str, manager: EnvManagerConfig, cfg: Any) -> list[str]:
    problems = []
    unknown = [t for t in manager.tags if t not in cfg.custom_envs]
    if unknown:
        defined = ", ".join(sorted(cfg.custom_envs)) or "none"
        problems.append(
            f"{where}.tags: {unknown} are not in custom_envs (defined: {defined}); add them "
            "there or fix the tag"
        )
    if manager.num_env_groups < 1:
        problems.append(f"{where}.num_env_groups: {manager.num_env_groups}; must be >= 1")
    if manager.group_size < 1:
        problems.append(f"{where}.group_size: {manager.group_size}; must be >= 1")
    partition = manager.num_groups_partition
    if partition is not None and (
        len(partition) != len(manager.tags) or sum(partition) != manager.num_env_groups
    ):
        problems.append(
            f"{where}.num_groups_partition: {list(partition)} must have one entry per tag "
            f"({len(manager.tags)}) summing to num_env_groups ({manager.num_env_groups}); or "
            "null to split evenly"
        )
    return problems


def held_out_only_problems(cfg: Any) -> list[str]:
    """Held-out episodes without training ones: the environments, the tags that name them, and
    what playing any episode needs (its timeout, seeds, workers, an engine that seeds each
    request); the training-only settings (estimator, reward mode) do not apply."""
    problems: list[str] = []
    for name, spec in cfg.custom_envs.items():
        problems += _env_problems(f"custom_envs.{name}", spec, cfg)
    problems += _manager_problems("val_env_manager", cfg.val_env_manager, cfg)
    return problems + _episode_problems(cfg)


def _runner_problems(cfg: Any) -> list[str]:
    problems = []
    agentic, algo = cfg.agentic, cfg.algorithm
    if agentic.reward_mode not in REWARD_MODES:
        problems.append(
            f"agentic.reward_mode: {agentic.reward_mode!r}; valid: {', '.join(REWARD_MODES)}"
        )
    if not 0.0 <= agentic.turn_gamma <= 1.0:
        problems.append(f"agentic.turn_gamma: {agentic.turn_gamma}; must be in [0, 1]")
    if agentic.reward_mode == "per_turn" and algo.adv_estimator != "grpo":
        problems.append(
            f"agentic.reward_mode: per_turn normalises turn returns by the group (grpo); "
            f"algorithm.adv_estimator is {algo.adv_estimator!r}: set it to grpo or use "
            "reward_mode: trajectory"
        )
    if algo.adv_estimator not in GROUP_ESTIMATORS:
        problems.append(
            f"algorithm.adv_estimator: {algo.adv_estimator!r}; agentic episodes train with a "
            f"group estimator ({', '.join(GROUP_ESTIMATORS)})"
        )
    problems += _episode_problems(cfg)
    if algo.dynamic_sampling:
        problems.append(
            "algorithm.dynamic_sampling: not available for agentic episodes yet; set it to false"
        )
    return problems


def _episode_problems(cfg: Any) -> list[str]:
    """What playing any episode needs, training or held-out."""
    problems = []
    agentic = cfg.agentic
    if agentic.step_timeout_s <= 0:
        problems.append(f"agentic.step_timeout_s: {agentic.step_timeout_s}; must be > 0")
    problems += _seed_offset_problems(cfg)
    if agentic.num_env_workers < 1:
        problems.append(f"agentic.num_env_workers: {agentic.num_env_workers}; must be >= 1")
    infer = cfg.actor_infer.strategy_args.strategy_name
    if infer in STRATEGY_SPECS and not STRATEGY_SPECS[infer].per_request_seeds:
        engines = sorted(n for n, s in STRATEGY_SPECS.items() if s.per_request_seeds)
        problems.append(
            f"actor_infer.strategy_args.strategy_name: {infer!r} cannot seed and limit each "
            f"episode's turn on its own, which environment episodes need; use one of {engines}"
        )
    return problems


def _seed_offset_problems(cfg: Any) -> list[str]:
    """Training episodes draw their environment seeds from [0, val_seed_offset), held-out ones
    use val_seed_offset + group: the range must not be empty and every seed must stay a seed
    (0..2**32 - 1, what numpy and vLLM take)."""
    offset = cfg.agentic.val_seed_offset
    top = SEED_MAX + 1 - max(cfg.val_env_manager.num_env_groups, 1)
    if 1 <= offset <= top:
        return []
    return [
        f"agentic.val_seed_offset: {offset}; training seeds are drawn from [0, val_seed_offset) "
        f"and held-out seeds start at it, so it must be in [1, {top}] (every seed within "
        f"0..{SEED_MAX}); e.g. 1000000"
    ]
