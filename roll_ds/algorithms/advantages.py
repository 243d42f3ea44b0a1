"""Advantage estimators: per-sequence scores (and values, for GAE) -> per-token advantages.

Every estimator returns ``(advantages_BT, returns_BT)``, zero outside the response mask.
``returns_BT`` is always the reward-to-go of the token rewards (score on the last valid token,
minus ``kl_coef * kl`` per token when KL is folded into the reward): discounted by ``gamma`` for
the Reinforce++ family, ``advantages + values`` for GAE, undiscounted for the outcome estimators.

Groups are contiguous: rollouts ``[g*G, (g+1)*G)`` answer prompt ``g`` (``G`` =
``num_return_sequences_in_group``, ``B = num_prompts * G``).

    grpo                          (r - mean_g) / (std_g + eps); std is torch.std (unbiased, as
                                  DeepSeekMath and veRL); groups with identical rewards give 0
    dr_grpo                       r - mean_g (no std). Dr.GRPO's other half, no length
                                  normalisation, is the loss aggregation: pair it with
                                  agg_mode="seq-mean-token-sum-norm", norm_constant=max length
    rloo                          r_i - mean of the other G-1 rewards of its group
    reinforce_plus_plus           discounted return of the token rewards, whitened over the batch
    reinforce_plus_plus_baseline  the same after subtracting the group mean score
    gae                           GAE(gamma, lam) over token rewards and critic values

For the outcome estimators (grpo, dr_grpo, rloo) with KL in the reward, the sequence reward is
``score - kl_coef * sum_t kl_t``.

``whiten_advantages`` whitens the final advantages of any estimator over the batch's valid tokens
(a no-op for the Reinforce++ family, which always whitens); ``returns_BT`` are never whitened.
Which inputs each estimator reads is the torch-free table ``roll_ds.config.estimators``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from roll_ds.algorithms.masks import last_token_index, masked_sum, masked_whiten
from roll_ds.config.estimators import ALWAYS_WHITENED, ESTIMATOR_OPTIONS
from roll_ds.registry import Registry


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """What an estimator may read. An estimator rejects (ValueError) an input it would ignore."""

    scores_B: Tensor
    response_mask_BT: Tensor
    group_size: int = 1  # num_return_sequences_in_group
    values_BT: Tensor | None = None  # critic values (gae only)
    kl_BT: Tensor | None = None  # per-token KL, folded into rewards when kl_coef > 0
    kl_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = False  # every estimator; the Reinforce++ family always whitens
    eps: float = 1e-6  # grpo std epsilon


@dataclass(frozen=True)
class AdvantageEstimator:
    fn: Callable[[AdvantageInputs], tuple[Tensor, Tensor]]
    # Inputs it reads beyond scores/mask/group/kl/whitening; values_BT and the options in
    # _OPTION_DEFAULTS that it does not list must stay unset / at their defaults.
    options: frozenset[str] = frozenset()


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
_OPTION_DEFAULTS = {"gamma": 1.0, "lam": 1.0}


def check_group_size(batch_size: int, group_size: int) -> None:
    if group_size < 1:
        raise ValueError(
            f"group size (num_return_sequences_in_group) must be >= 1, got {group_size}"
        )
    if batch_size % group_size != 0:
        raise ValueError(
            f"batch of {batch_size} rollouts is not divisible by group size {group_size} "
            "(num_return_sequences_in_group); expected B = num_prompts * G with each prompt's "
            "G rollouts contiguous"
        )


def token_level_rewards(
    scores_B: Tensor,
    response_mask_BT: Tensor,
    kl_BT: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """``[B, T]`` rewards: the score on each row's last valid token, ``- kl_coef * kl`` on every
    valid token (KL as a reward penalty). Rows without valid tokens get no score."""
    mask_BT = response_mask_BT.bool()
    dtype = scores_B.dtype if scores_B.is_floating_point() else torch.float32
    rewards_BT = torch.zeros(mask_BT.shape, dtype=dtype, device=scores_B.device)
    if kl_coef != 0.0:
        if kl_BT is None:
            raise ValueError("kl_coef != 0 needs kl_BT (per-token KL to the reference)")
        rewards_BT = rewards_BT - kl_coef * torch.where(mask_BT, kl_BT.to(dtype), 0.0)
    last_B = last_token_index(mask_BT)
    placed_B = torch.where(last_B >= 0, scores_B.to(dtype), 0.0)
    return rewards_BT.scatter_add(1, last_B.clamp(min=0)[:, None], placed_B[:, None])


def discounted_returns(token_rewards_BT: Tensor, response_mask_BT: Tensor, gamma: float) -> Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens (masked ones are skipped)."""
    mask_BT = response_mask_BT.bool()
    rewards_BT = torch.where(mask_BT, token_rewards_BT, 0.0)
    if gamma == 1.0:
        return torch.where(mask_BT, rewards_BT.flip(-1).cumsum(-1).flip(-1), 0.0)
    returns_BT = torch.zeros_like(rewards_BT)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        running_B = torch.where(mask_BT[:, t], rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = torch.where(mask_BT[:, t], running_B, 0.0)
    return returns_BT


def _sequence_rewards(inputs: AdvantageInputs) -> Tensor:
    scores_B = inputs.scores_B.to(torch.float32)
    if inputs.kl_coef == 0.0:
        return scores_B
    if inputs.kl_BT is None:
        raise ValueError("kl_coef != 0 needs kl_BT (per-token KL to the reference)")
    return scores_B - inputs.kl_coef * masked_sum(inputs.kl_BT.float(), inputs.response_mask_BT, -1)


def _broadcast(per_seq_B: Tensor, response_mask_BT: Tensor) -> Tensor:
    return torch.where(response_mask_BT.bool(), per_seq_B[:, None], 0.0)


def _outcome_returns(inputs: AdvantageInputs) -> Tensor:
    token_rewards_BT = token_level_rewards(
        inputs.scores_B, inputs.response_mask_BT, inputs.kl_BT, inputs.kl_coef
    )
    return discounted_returns(token_rewards_BT, inputs.response_mask_BT, 1.0)


def _groups(rewards_B: Tensor, group_size: int) -> Tensor:
    check_group_size(rewards_B.shape[0], group_size)
    return rewards_B.view(-1, group_size)


def grpo_advantages(
    rewards_B: Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sequence GRPO advantages ``[B]``: ``(r - mean_g) / (std_g + eps)``, std unbiased.

    Groups whose rewards are all equal (including G = 1) give exactly 0.
    """
    rewards_NG = _groups(rewards_B.float(), group_size)
    centered_NG = rewards_NG - rewards_NG.mean(-1, keepdim=True)
    if norm_by_std and group_size > 1:
        centered_NG = centered_NG / (rewards_NG.std(-1, keepdim=True) + eps)
    constant_N1 = (rewards_NG.amax(-1) == rewards_NG.amin(-1))[:, None]
    return torch.where(constant_N1, 0.0, centered_NG).reshape(-1)


def rloo_advantages(rewards_B: Tensor, group_size: int) -> Tensor:
    """Per-sequence leave-one-out advantages ``[B]``: ``r_i - mean_{j != i} r_j``."""
    if group_size < 2:
        raise ValueError(
            f"rloo needs group size >= 2 (num_return_sequences_in_group), got {group_size}"
        )
    rewards_NG = _groups(rewards_B.float(), group_size)
    others_mean_NG = (rewards_NG.sum(-1, keepdim=True) - rewards_NG) / (group_size - 1)
    return (rewards_NG - others_mean_NG).reshape(-1)


def gae_advantages(
    token_rewards_BT: Tensor,
    values_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns ``(advantages_BT, returns_BT)``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, with
    ``V`` and ``A`` beyond the last valid token 0 and masked tokens skipped. ``returns = A + V``
    (before whitening); ``whiten`` then normalises the advantages over the batch.
    """
    mask_BT = response_mask_BT.bool()
    rewards_BT = torch.where(mask_BT, token_rewards_BT.float(), 0.0)
    values_BT = torch.where(mask_BT, values_BT.float(), 0.0)
    advantages_BT = torch.zeros_like(rewards_BT)
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    next_adv_B = torch.zeros_like(next_value_B)
    for t in reversed(range(rewards_BT.shape[1])):
        valid_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        next_adv_B = torch.where(valid_B, adv_B, next_adv_B)
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        advantages_BT[:, t] = torch.where(valid_B, adv_B, 0.0)
    returns_BT = advantages_BT + values_BT
    if whiten:
        advantages_BT = masked_whiten(advantages_BT, mask_BT)
    return advantages_BT, returns_BT


def _check(name: str, inputs: AdvantageInputs, options: frozenset[str]) -> None:
    if inputs.values_BT is not None and "values_BT" not in options:
        raise ValueError(f"advantage estimator '{name}' does not use critic values (values_BT)")
    for option, default in _OPTION_DEFAULTS.items():
        if option not in options and getattr(inputs, option) != default:
            raise ValueError(
                f"{option}={getattr(inputs, option)} has no effect with advantage estimator "
                f"'{name}'; leave it at {default}"
            )


def compute_advantages(estimator: str, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Run the named estimator: ``(advantages_BT, returns_BT)``; with ``whiten_advantages`` the
    advantages are whitened over the valid tokens of the whole batch."""
    entry = ADVANTAGE_ESTIMATORS.get(estimator)
    _check(estimator, inputs, entry.options)
    advantages_BT, returns_BT = entry.fn(inputs)
    if inputs.whiten_advantages and estimator not in ALWAYS_WHITENED:
        advantages_BT = masked_whiten(advantages_BT, inputs.response_mask_BT)
    return advantages_BT, returns_BT


def _register(name: str) -> Callable:
    """Register an estimator with the options ``ESTIMATOR_OPTIONS`` lists for ``name``."""

    def decorate(fn: Callable[[AdvantageInputs], tuple[Tensor, Tensor]]) -> Callable:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(fn, ESTIMATOR_OPTIONS[name]))
        return fn

    return decorate


@_register("grpo")
def _grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv_B = grpo_advantages(_sequence_rewards(inputs), inputs.group_size, eps=inputs.eps)
    return _broadcast(adv_B, inputs.response_mask_BT), _outcome_returns(inputs)


@_register("dr_grpo")
def _dr_grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv_B = grpo_advantages(_sequence_rewards(inputs), inputs.group_size, norm_by_std=False)
    return _broadcast(adv_B, inputs.response_mask_BT), _outcome_returns(inputs)


@_register("rloo")
def _rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv_B = rloo_advantages(_sequence_rewards(inputs), inputs.group_size)
    return _broadcast(adv_B, inputs.response_mask_BT), _outcome_returns(inputs)


def _reinforce_pp(inputs: AdvantageInputs, scores_B: Tensor) -> tuple[Tensor, Tensor]:
    token_rewards_BT = token_level_rewards(
        scores_B, inputs.response_mask_BT, inputs.kl_BT, inputs.kl_coef
    )
    returns_BT = discounted_returns(token_rewards_BT, inputs.response_mask_BT, inputs.gamma)
    return masked_whiten(returns_BT, inputs.response_mask_BT), returns_BT


@_register("reinforce_plus_plus")
def _reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return _reinforce_pp(inputs, inputs.scores_B.float())


@_register("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores_NG = _groups(inputs.scores_B.float(), inputs.group_size)
    baselined_B = (scores_NG - scores_NG.mean(-1, keepdim=True)).reshape(-1)
    return _reinforce_pp(inputs, baselined_B)


@_register("gae")
def _gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if inputs.values_BT is None:
        raise ValueError(
            "advantage estimator 'gae' needs critic values (values_BT): configure a critic"
        )
    token_rewards_BT = token_level_rewards(
        inputs.scores_B, inputs.response_mask_BT, inputs.kl_BT, inputs.kl_coef
    )
    return gae_advantages(
        token_rewards_BT,
        inputs.values_BT,
        inputs.response_mask_BT,
        gamma=inputs.gamma,
        lam=inputs.lam,
    )
