"""Bad agentic configs fail before anything starts, each problem naming its field and fix."""

from __future__ import annotations

import pytest

from roll_ds.config import ConfigError
from roll_ds.config.compose import load_config


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config("agentic_lora_zero3", list(overrides), check_files=False)
    return info.value.problems


def test_shipped_agentic_configs_validate():
    for name in ("agentic_lora_zero3", "agentic_guess_number", "agentic_calculator"):
        cfg = load_config(name, [], check_files=False)
        assert cfg.train_env_manager.tags


def test_unknown_environment_names_the_field_and_the_valid_ones():
    (p,) = problems("custom_envs.GuessNumber.env_type=guess_numbr")
    assert p.startswith("custom_envs.GuessNumber.env_type: unknown environment 'guess_numbr'")
    assert "calculator, guess_number" in p and "module:Class" in p


def test_import_path_environment_is_checked_by_finding_its_module():
    (p,) = problems("custom_envs.GuessNumber.env_type=no_such_pkg.envs:Env")
    assert "cannot find module 'no_such_pkg.envs'" in p
    load_config(
        "agentic_lora_zero3",
        ["custom_envs.GuessNumber.env_type=roll_ds.agentic.envs.guess_number:GuessNumberEnv"],
        check_files=False,
    )


def test_unknown_tag_parser_and_tool():
    found = problems(
        "train_env_manager.tags=[GuessNumber,Sokoban]",
        "train_env_manager.num_groups_partition=[8,8]",
        "+custom_envs.Calculator.env_config.parser=xml",
        "+custom_envs.Calculator.env_config.tools=[calc2]",
    )
    text = "\n".join(found)
    assert "train_env_manager.tags: ['Sokoban'] are not in custom_envs" in text
    assert "custom_envs.Calculator.env_config.parser: unknown tool parser 'xml'" in text
    assert "custom_envs.Calculator.env_config.tools: unknown tool 'calc2'" in text


def test_turn_limits_and_budget():
    found = problems(
        "custom_envs.GuessNumber.max_actions_per_traj=0",
        "custom_envs.Calculator.max_tokens_per_step=500",
    )
    text = "\n".join(found)
    assert "custom_envs.GuessNumber.max_actions_per_traj: 0; an episode needs at least" in text
    assert "custom_envs.Calculator.max_tokens_per_step: 500 is more than the whole episode" in text


def test_group_layout_and_unsupported_modes():
    found = problems(
        "rollout_batch_size=4",
        "train_env_manager.num_groups_partition=[3,3]",
        "agentic.reward_mode=per_step",
        "async_generation.max_staleness=1",
        "actor_infer.strategy_args.strategy_name=hf_infer",
    )
    text = "\n".join(found)
    assert "train_env_manager.num_env_groups: 16 of rollout_batch_size 4 groups per step" in text
    assert "train_env_manager.num_groups_partition: [3, 3] must have one entry per tag" in text
    assert "agentic.reward_mode: 'per_step'; valid: trajectory, per_turn" in text
    assert not any("max_staleness" in p for p in found)  # episodes are played ahead (async)
    assert "actor_infer.strategy_args.strategy_name: 'hf_infer' cannot seed and limit" in text


def test_fewer_environment_groups_than_the_batch_are_dataset_rows():
    """A mixed step: the groups beyond train_env_manager's are rows of actor_train's data."""
    found = problems("rollout_batch_size=20")
    (p,) = [p for p in found if p.startswith("rollout_batch_size: 20 groups per step")]
    assert "the other 4 are dataset rows, but actor_train.data_args.file_name lists" in p


def test_per_turn_needs_grpo():
    (p,) = problems("agentic.reward_mode=per_turn", "algorithm.adv_estimator=rloo")
    assert p.startswith("agentic.reward_mode: per_turn normalises turn returns")


@pytest.mark.parametrize("offset", [0, -1, 2**32 - 1])
def test_val_seed_offset_leaves_room_for_the_training_and_held_out_seeds(offset):
    # 0 or less: training seeds are drawn from an empty range (randrange raised in the actors);
    # near 2**32: held-out seeds (offset + group) leave the seed range
    (p,) = problems(f"agentic.val_seed_offset={offset}")
    top = (
        2**32
        - load_config("agentic_lora_zero3", [], check_files=False).val_env_manager.num_env_groups
    )
    assert p == (
        f"agentic.val_seed_offset: {offset}; training seeds are drawn from [0, val_seed_offset) "
        f"and held-out seeds start at it, so it must be in [1, {top}] (every seed within "
        "0..4294967295); e.g. 1000000"
    )


def test_each_environment_caps_its_replies_and_the_runner_gets_the_cap():
    from roll_ds.agentic.runner import TurnLimits

    cfg = load_config(
        "agentic_lora_zero3",
        ["custom_envs.Calculator.max_observation_tokens=256"],
        check_files=False,
    )
    assert TurnLimits.of(cfg.custom_envs["Calculator"]) == TurnLimits(3, 80, 256, "middle")
    assert cfg.custom_envs["GuessNumber"].max_observation_tokens == 1024  # the default
    found = problems(
        "custom_envs.GuessNumber.max_observation_tokens=0",
        "custom_envs.Calculator.observation_truncation_side=top",
    )
    assert found == [
        "custom_envs.GuessNumber.max_observation_tokens: 0; must be >= 1 (tokens kept of each "
        "reply message), or null for no cap",
        "custom_envs.Calculator.observation_truncation_side: 'top'; valid: left, right, middle "
        "(the side cut)",
    ]
