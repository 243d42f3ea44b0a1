"""KL estimators against the reference policy, and entropy.

Per-token estimators of KL(pi || pi_ref) from sampled-token log-probs (Schulman, "Approximating
KL divergence"), with ``log_ratio = logprobs - ref_logprobs``:

    k1  log_ratio                                  unbiased, can be negative
    k2  0.5 * log_ratio**2                         biased, low variance, >= 0
    k3  (r - 1) - log r,  r = exp(ref - logprobs)  unbiased, low variance, >= 0 ("low_var_kl")

Use them either as a loss term (``kl_loss``: aggregated like the policy loss, scaled by the
caller's ``kl_coef``) or as a reward penalty (``kl_penalty`` -> ``token_level_rewards(...,
kl_BT, kl_coef)`` in ``advantages``), not both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from roll_ds.algorithms.aggregation import aggregate_loss
from roll_ds.registry import Registry

KlFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KlFn] = Registry("kl estimator")

# exp() argument bound in k3: keeps fp32 finite for absurd log-ratios (as veRL's low_var_kl).
_MAX_LOG_RATIO = 20.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    return logprobs_BT - ref_logprobs_BT


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    return 0.5 * (logprobs_BT - ref_logprobs_BT) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    log_r = (ref_logprobs_BT - logprobs_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.expm1(log_r) - log_r


def kl_penalty(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    estimator: str = "k3",
    *,
    clamp: float | None = None,
) -> Tensor:
    """Per-token KL estimate ``[B, T]``, optionally clamped to ``[-clamp, clamp]``."""
    kl_BT = KL_ESTIMATORS.get(estimator)(logprobs_BT, ref_logprobs_BT)
    if clamp is not None:
        kl_BT = kl_BT.clamp(-clamp, clamp)
    return kl_BT


def kl_loss(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    estimator: str = "k3",
    clamp: float | None = None,
    agg_mode: str = "token-mean",
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Aggregated KL to the reference as a scalar loss term (unscaled: multiply by kl_coef)."""
    kl_BT = kl_penalty(logprobs_BT, ref_logprobs_BT, estimator, clamp=clamp)
    return aggregate_loss(
        kl_BT, response_mask_BT, agg_mode, norm_constant=norm_constant, denominator=denominator
    )


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position, ``[B, T]``, computed in float32 at least.

    ``-sum p log p`` via log_softmax; ``-inf`` logits (masked vocabulary) contribute 0.
    """
    logits = (
        logits_BTV.float() if logits_BTV.dtype in (torch.float16, torch.bfloat16) else logits_BTV
    )
    logp_BTV = torch.log_softmax(logits, dim=-1)
    p_BTV = logp_BTV.exp()
    return -(p_BTV * logp_BTV.masked_fill(p_BTV == 0, 0.0)).sum(-1)


def entropy_bonus(
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    coef: float,
    agg_mode: str = "token-mean",
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    """The term to *add to the loss* for an entropy bonus: ``-coef * aggregate(entropy)``."""
    entropy = aggregate_loss(
        entropy_BT, response_mask_BT, agg_mode, norm_constant=norm_constant, denominator=denominator
    )
    return -coef * entropy
