"""Rule-based rewards (RLVR): math-verify correctness, format checks, exact match.

Importing this package is light: math-verify (sympy) is imported only when a ``math_rule``
reward is used. Entry points:

* :func:`roll_ds.rewards.build.build_reward_fn` - a reward function from a config spec;
* :class:`roll_ds.rewards.scorer.RewardScorer` - what a reward worker hosts (scores + metrics).
"""

from roll_ds.rewards.base import FunctionReward, RewardFn, RewardOutput, RewardSample
from roll_ds.rewards.build import build_reward_fn, validate_reward_specs
from roll_ds.rewards.registry import REWARD_FNS
from roll_ds.rewards.scorer import RewardScorer

__all__ = [
    "REWARD_FNS",
    "FunctionReward",
    "RewardFn",
    "RewardOutput",
    "RewardSample",
    "RewardScorer",
    "build_reward_fn",
    "validate_reward_specs",
]
