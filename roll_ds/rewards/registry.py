"""Reward functions by name: ``REWARD_FNS``, one entry per reward kind.

The entries are lazy (``"module:attr"``), so names can be listed and configs validated without
importing math-verify or a model. A function of your own needs no entry: name its
:class:`~roll_ds.rewards.base.RewardFn` subclass by import path in the config
(``reward_fns: [{name: "mymod:MyReward"}]``, resolved like ``env_type``: ``Registry.resolve``);
``@REWARD_FNS.register("my_reward")`` registers one under a name. ``roll_ds.rewards.build``
turns a config's reward specs into functions through ``reward_class``.
"""

from __future__ import annotations

from roll_ds.registry import Registry, import_path_problem, is_import_path
from roll_ds.rewards.base import RewardFn

REWARD_FNS: Registry[type[RewardFn]] = Registry("reward function")
REWARD_FNS.register_lazy("math_rule", "roll_ds.rewards.math_rule:MathRuleReward")
REWARD_FNS.register_lazy("format", "roll_ds.rewards.format:FormatReward")
REWARD_FNS.register_lazy("exact_match", "roll_ds.rewards.exact_match:ExactMatchReward")
REWARD_FNS.register_lazy("model", "roll_ds.rewards.model_reward:ModelReward")
REWARD_FNS.register_lazy("judge", "roll_ds.rewards.judge:JudgeReward")
REWARD_FNS.register_lazy("code", "roll_ds.rewards.code_reward:CodeReward")
REWARD_FNS.register_lazy("weighted_sum", "roll_ds.rewards.build:WeightedSumReward")


def reward_class(name: str) -> type[RewardFn]:
    """The reward function class ``name`` names: a registered name, or an import path
    ``module:Class`` of a :class:`RewardFn` subclass."""
    cls = REWARD_FNS.resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, RewardFn)):
        raise ValueError(
            f"{name!r} is not a reward function: it names {cls!r}, not a subclass of "
            "roll_ds.rewards.base.RewardFn"
        )
    return cls


def reward_name_problem(name: str) -> str | None:
    """Why ``name`` names no reward function, or None. An import path is imported (in the
    driver, as validation imports every reward class) and checked to be a ``RewardFn``."""
    if name in REWARD_FNS:
        return None
    if not is_import_path(name):
        return REWARD_FNS.unknown_message(name) + "; or an import path module:Class"
    problem = import_path_problem(name)
    if problem is None:
        try:
            reward_class(name)
        except ValueError as exc:
            problem = str(exc)
    return problem
