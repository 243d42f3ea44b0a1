"""Algorithms: advantages, policy / value losses, KL and entropy, masks, loss aggregation.

Pure torch on ``[B, T]`` response-token tensors; no Ray, no DeepSpeed.
"""

from roll_ds.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    token_level_rewards,
)
from roll_ds.algorithms.aggregation import AGG_MODES, aggregate_loss
from roll_ds.algorithms.kl import (
    KL_ESTIMATORS,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
)
from roll_ds.algorithms.masks import (
    mask_truncated,
    masked_mean,
    masked_whiten,
    overlong_soft_penalty,
    response_mask_from_eos,
    response_mask_from_lengths,
    truncated_sequences,
)
from roll_ds.algorithms.policy_loss import ppo_policy_loss, rollout_mismatch_metrics, tis_weights
from roll_ds.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "AdvantageInputs",
    "aggregate_loss",
    "compute_advantages",
    "discounted_returns",
    "entropy_bonus",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "mask_truncated",
    "masked_mean",
    "masked_whiten",
    "overlong_soft_penalty",
    "ppo_policy_loss",
    "response_mask_from_eos",
    "response_mask_from_lengths",
    "rloo_advantages",
    "rollout_mismatch_metrics",
    "tis_weights",
    "token_level_rewards",
    "truncated_sequences",
    "value_loss",
]
