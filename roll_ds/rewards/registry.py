"""Reward functions by name: ``REWARD_FNS``, one entry per reward kind.

The entries are lazy (``"module:attr"``), so names can be listed and configs validated without
importing math-verify or a model. Register a custom function with
``@REWARD_FNS.register("my_reward")`` on a :class:`~roll_ds.rewards.base.RewardFn` subclass;
``roll_ds.rewards.build`` turns a config's reward specs into functions through this registry.
"""

from __future__ import annotations

from roll_ds.registry import Registry
from roll_ds.rewards.base import RewardFn

REWARD_FNS: Registry[type[RewardFn]] = Registry("reward function")
REWARD_FNS.register_lazy("math_rule", "roll_ds.rewards.math_rule:MathRuleReward")
REWARD_FNS.register_lazy("format", "roll_ds.rewards.format:FormatReward")
REWARD_FNS.register_lazy("exact_match", "roll_ds.rewards.exact_match:ExactMatchReward")
REWARD_FNS.register_lazy("model", "roll_ds.rewards.model_reward:ModelReward")
REWARD_FNS.register_lazy("judge", "roll_ds.rewards.judge:JudgeReward")
REWARD_FNS.register_lazy("code", "roll_ds.rewards.code_reward:CodeReward")
REWARD_FNS.register_lazy("weighted_sum", "roll_ds.rewards.build:WeightedSumReward")
