"""PPO-clip policy loss (clip-higher, dual clip, GSPO sequence ratio) and rollout corrections.

Per token, with ratio ``r = exp(logprobs - old_logprobs)`` and advantage ``A``:

    loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))        PPO, asymmetric clip
    loss = min(loss, -A * dual_clip)             where A < 0              dual clip (Ye et al.)

``ratio_level="sequence"`` is GSPO: the ratio of every token of sequence i is
``s_i = exp(mean_t log-ratio)`` (GSPO-token form: value ``s_i``, gradient ``s_i * grad logp_t``),
clipped with its own, much tighter range ``seq_clip_low`` / ``seq_clip_high`` (paper: 3e-4 /
4e-4); ``clip_low`` / ``clip_high`` are then unused. Pair it with agg_mode="seq-mean-token-mean"
to get GSPO's per-sequence objective exactly.

Truncated importance sampling (TIS) corrects for the rollout engine (vLLM) sampling from a
slightly different distribution than the trainer's old policy: multiply the per-token loss by
``tis_weights(old_logprobs_BT, rollout_logprobs_BT, cap)`` (``is_weights_BT``). The other
corrections (sequence TIS, IcePop, the geometric-mean mask) are in ``corrections.py``;
``rollout_mismatch_metrics`` measures the gap they correct for.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from roll_ds.algorithms.aggregation import aggregate_loss
from roll_ds.algorithms.masks import masked_mean

RATIO_LEVELS = ("token", "sequence")
_MAX_LOG_RATIO = 20.0  # exp() bound: ratios beyond e^20 are clipped anyway


def _masked_max(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    if not mask_BT.any():
        return torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)
    return torch.where(mask_BT, values_BT, -math.inf).amax()


def _k3_from_log_ratio(log_ratio: Tensor) -> Tensor:
    return torch.expm1(log_ratio) - log_ratio


def _validate(clip_low: float, clip_high: float, dual_clip: float | None, ratio_level: str) -> None:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level '{ratio_level}'; valid: {', '.join(RATIO_LEVELS)}")


def ppo_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    seq_clip_low: float = 3e-4,
    seq_clip_high: float = 4e-4,
    agg_mode: str = "token-mean",
    norm_constant: float | None = None,
    denominator: float | None = None,
    is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar PPO-clip loss and detached metrics over valid tokens.

    Metrics: ``clipfrac_low`` (A < 0, r < 1 - low), ``clipfrac_high`` (A > 0, r > 1 + high),
    ``clipfrac`` (their sum: tokens whose gradient the clip removed), ``dual_clipfrac``,
    ``approx_kl`` (k3 estimate of KL(old || new) from the token log-ratios), ``ratio_mean``,
    ``ratio_max`` (at ``ratio_level``).
    """
    low, high = (
        (seq_clip_low, seq_clip_high) if ratio_level == "sequence" else (clip_low, clip_high)
    )
    _validate(low, high, dual_clip, ratio_level)
    mask_BT = response_mask_BT.bool()
    token_log_ratio_BT = torch.where(mask_BT, logprobs_BT - old_logprobs_BT, 0.0)
    ratio_BT = _ratio(logprobs_BT, token_log_ratio_BT, mask_BT, ratio_level)
    adv_BT = torch.where(mask_BT, advantages_BT, 0.0)
    loss_BT, dual_active_BT = _clipped_token_loss(ratio_BT, adv_BT, low, high, dual_clip)
    if is_weights_BT is not None:
        loss_BT = loss_BT * is_weights_BT.detach()
    loss = aggregate_loss(
        loss_BT, mask_BT, agg_mode, norm_constant=norm_constant, denominator=denominator
    )
    metrics = _clip_metrics(
        ratio_BT, adv_BT, token_log_ratio_BT, dual_active_BT, mask_BT, low, high
    )
    return loss, metrics


def _ratio(
    logprobs_BT: Tensor, token_log_ratio_BT: Tensor, mask_BT: Tensor, ratio_level: str
) -> Tensor:
    """The importance ratio per token: the token's own, or (GSPO) its sequence's geometric
    mean with the token's gradient (value ``s_i``, gradient ``s_i * grad logp_t``)."""
    if ratio_level == "sequence":
        seq_log_ratio_B = token_log_ratio_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)
        log_ratio_BT = seq_log_ratio_B.detach()[:, None] + logprobs_BT - logprobs_BT.detach()
        log_ratio_BT = torch.where(mask_BT, log_ratio_BT, 0.0)
    else:
        log_ratio_BT = token_log_ratio_BT
    return torch.exp(log_ratio_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _clipped_token_loss(
    ratio_BT: Tensor, adv_BT: Tensor, low: float, high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss (asymmetric clip, then dual clip for A < 0) and where the dual
    clip bound."""
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - low, 1.0 + high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_active_BT = torch.zeros_like(adv_BT, dtype=torch.bool)
    if dual_clip is not None:
        dual_bound_BT = -adv_BT * dual_clip
        dual_active_BT = (adv_BT < 0) & (dual_bound_BT < loss_BT)
        loss_BT = torch.where(dual_active_BT, dual_bound_BT, loss_BT)
    return loss_BT, dual_active_BT


@torch.no_grad()
def _clip_metrics(
    ratio_BT: Tensor,
    adv_BT: Tensor,
    token_log_ratio_BT: Tensor,
    dual_active_BT: Tensor,
    mask_BT: Tensor,
    low: float,
    high: float,
) -> dict[str, Tensor]:
    clip_low_BT = (adv_BT < 0) & (ratio_BT < 1.0 - low)
    clip_high_BT = (adv_BT > 0) & (ratio_BT > 1.0 + high)
    metrics = {
        "clipfrac_low": masked_mean(clip_low_BT.float(), mask_BT),
        "clipfrac_high": masked_mean(clip_high_BT.float(), mask_BT),
        "clipfrac": masked_mean((clip_low_BT | clip_high_BT).float(), mask_BT),
        "dual_clipfrac": masked_mean(dual_active_BT.float(), mask_BT),
        "approx_kl": masked_mean(_k3_from_log_ratio(token_log_ratio_BT), mask_BT),
        "ratio_mean": masked_mean(ratio_BT, mask_BT),
        "ratio_max": _masked_max(ratio_BT, mask_BT),
    }
    return {k: v.detach() for k, v in metrics.items()}


def tis_weights(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    cap: float,
    response_mask_BT: Tensor | None = None,
) -> Tensor:
    """Truncated IS weights ``min(pi_old / pi_rollout, cap)``, detached; 0 outside the mask."""
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    log_ratio_BT = (old_logprobs_BT - rollout_logprobs_BT).detach()
    if response_mask_BT is not None:
        log_ratio_BT = torch.where(response_mask_BT.bool(), log_ratio_BT, -math.inf)
    return torch.exp(log_ratio_BT.clamp(max=_MAX_LOG_RATIO)).clamp(max=cap)


def rollout_mismatch_metrics(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, response_mask_BT: Tensor
) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's (same weights, in theory).

    ``mismatch_abs_logprob_diff``: mean |old - rollout|; ``mismatch_k3_kl``: k3 estimate of
    KL(rollout || old) from rollout samples; ``mismatch_ratio_max``: max pi_old / pi_rollout.
    """
    mask_BT = response_mask_BT.bool()
    with torch.no_grad():
        log_ratio_BT = torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0)
        log_ratio_BT = log_ratio_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return {
            "mismatch_abs_logprob_diff": masked_mean(log_ratio_BT.abs(), mask_BT),
            "mismatch_k3_kl": masked_mean(_k3_from_log_ratio(log_ratio_BT), mask_BT),
            "mismatch_ratio_max": _masked_max(log_ratio_BT.exp(), mask_BT),
        }
