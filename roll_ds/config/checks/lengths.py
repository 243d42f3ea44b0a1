"""Generation lengths against ``response_length``, and against the rollout engine's context
(the actor_infer backend's ``StrategySpec.rollout_checks``); a generation cap below
``response_length`` that cuts every answer short is a warning (``generation_cap_warnings``)."""

from __future__ import annotations

from roll_ds.config.agentic import has_environments, row_groups
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


def generation_cap_warnings(cfg: RLVRConfig) -> list[str]:
    """A ``max_new_tokens`` below ``response_length`` in a run of dataset rows only: every answer
    (rollout, or held-out with evaluation on) stops at the cap, though the lengths, the loss
    normalization and the overlong penalty count on ``response_length``. The usual cause is a
    config deriving from one that fixes the cap (``max_new_tokens: 8`` in the parent is kept
    when the child raises ``response_length``). With environment episodes ``response_length``
    is an episode's budget and a row's own cap is expected to be smaller: not warned."""
    if has_environments(cfg) or row_groups(cfg) < 1:
        return []
    gens = [("actor_infer", cfg.actor_infer.generating_args)]
    if cfg.eval_steps > 0 and cfg.validation.data_args.file_name:
        gens.append(("validation", cfg.validation.generating_args))
    response = cfg.response_length
    warnings = []
    for where, gen in gens:
        cap = gen.max_new_tokens
        if cap is None or cap >= response:
            continue
        field = f"{where}.generating_args.max_new_tokens"
        warnings.append(
            f"{field}: {cap} < response_length {response}: every {where} answer stops at {cap} "
            f"tokens though response_length allows {response}. A fixed max_new_tokens is "
            "inherited from the config this one derives from (its defaults) unless set again "
            f"here or on the command line; set {field}: ${{response_length}} (or null) to "
            f"follow response_length, or response_length: {cap} if the cap is meant"
        )
    return warnings
