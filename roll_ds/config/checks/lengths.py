"""Generation lengths against ``response_length``, and against the rollout engine's context
(the actor_infer backend's ``StrategySpec.rollout_checks``)."""

from __future__ import annotations

from roll_ds.config.schema import RLVRConfig
from roll_ds.config.strategies import STRATEGY_SPECS, load_hook


def length_problems(cfg: RLVRConfig, *, check_files: bool) -> list[str]:
    problems = []
    response = cfg.response_length
    new_tokens = cfg.actor_infer.generating_args.max_new_tokens
    if new_tokens is not None and new_tokens > response:
        problems.append(
            f"actor_infer.generating_args.max_new_tokens: {new_tokens} > response_length "
            f"{response}; rollouts must fit response_length (the loss normalization and the "
            "overlong penalty count on it): set it to ${response_length} or null"
        )
    if cfg.algorithm.overlong_buffer_len > response:
        problems.append(
            f"algorithm.overlong_buffer_len: {cfg.algorithm.overlong_buffer_len} > "
            f"response_length {response}; the penalty window is the end of the response: "
            "lower it"
        )
    spec = STRATEGY_SPECS.get(cfg.actor_infer.strategy_args.strategy_name or "")
    if spec is not None and spec.rollout_checks is not None:
        problems += load_hook(spec.rollout_checks)(cfg, check_files=check_files)
    return problems


def longest_sequence(cfg: RLVRConfig) -> tuple[int, str]:
    """Tokens a rollout (or evaluation) sequence can reach, and how that adds up."""
    lengths = [(cfg.response_length, "response_length")]
    gens = [("actor_infer", cfg.actor_infer.generating_args)]
    if cfg.eval_steps:
        gens.append(("validation", cfg.validation.generating_args))
    for where, gen in gens:
        if gen.max_new_tokens is not None:
            lengths.append((gen.max_new_tokens, f"{where}.generating_args.max_new_tokens"))
    longest, name = max(lengths, key=lambda length: length[0])  # ties: response_length
    total = cfg.prompt_length + longest
    return total, f"prompt_length {cfg.prompt_length} + {name} {longest} = {total}"
