"""A reward role's checks, collected by ``roll_ds.config.validate``: its reward function specs
(``roll_ds.rewards.build``), its model settings (``roll_ds.rewards.model_reward``), its domains.
No model or math-verify import."""

from __future__ import annotations

from roll_ds.config.schema import RewardConfig


def reward_role_problems(name: str, role: RewardConfig) -> list[str]:
    """Problems of reward role ``name`` (``rewards.<role>``)."""
    from roll_ds.rewards.build import validate_reward_specs
    from roll_ds.rewards.model_reward import check_model_reward

    problems = [f"{name}.{p}" for p in validate_reward_specs(list(role.reward_fns))]
    problems += check_model_reward(name, role)  # reward model / judge
    if not role.tag_included:
        problems.append(f"{name}.tag_included: list the data domains this role scores")
    return problems
