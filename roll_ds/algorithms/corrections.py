"""Rollout corrections: weights on the per-token policy loss for the rollout engine (vLLM)
sampling from a slightly different policy than the trainer's old policy (numerics, or an
asynchronous batch a policy version old).

With the per-token log-ratio ``l_t = old_logprob_t - rollout_logprob_t`` (``rho_t = exp(l_t)``,
pi_old / pi_rollout) over the response tokens of sequence ``i``:

    token_tis  w_t = min(rho_t, cap)                                  truncated IS, per token
    seq_tis    w_t = min(exp(sum_t l_t), cap)  for every token of i    truncated IS, per sequence
    icepop     w_t = rho_t if low <= rho_t <= high, else 0            masked IS (IcePop, Ring-1T)
    geo_mask   w_t = 1 if low <= exp(mean_t l_t) <= high, else 0      geometric-mean sequence mask

IcePop follows Ring-1T's ``M(k) = k`` for ``k`` in ``[alpha, beta]``, ``0`` otherwise (defaults
0.5 / 5, the paper's): kept tokens are reweighted by their ratio, not by 1. geo_mask rejects whole
sequences whose geometric-mean ratio is off (defaults 0.999 / 1.001: the geometric mean of a
matching engine is within about 1e-3 of 1; veRL's "geometric" rejection sampling) and reweights
nothing.

A masked token (weight 0) contributes nothing to the policy-gradient loss but keeps its place in
the loss's denominator (IcePop's ``1 / |y_i|`` over every token; the mini-batch counts stay those
of the loss mask), so masking never rescales the other tokens' gradients. The KL-to-reference and
entropy terms are not reweighted.

Each correction is a pure function ``(old_logprobs_BT, rollout_logprobs_BT, mask_BT, params) ->
Correction``, registered by name in ``CORRECTIONS`` (``algorithm.rollout_correction``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from roll_ds.algorithms.masks import masked_mean
from roll_ds.algorithms.policy_loss import tis_weights
from roll_ds.registry import Registry

TIS_CAP = 2.0  # token_tis / seq_tis without a cap
ICEPOP_BOUNDS = (0.5, 5.0)  # Ring-1T's alpha, beta
GEO_MASK_BOUNDS = (0.999, 1.001)
_MAX_LOG_RATIO = 20.0  # exp() bound


@dataclass(frozen=True, kw_only=True)
class CorrectionParams:
    """What a correction reads (None: its default): ``cap`` (token_tis, seq_tis), ``low`` /
    ``high`` (icepop, geo_mask: the kept region of the ratio)."""

    cap: float | None = None
    low: float | None = None
    high: float | None = None


class Correction(NamedTuple):
    """``weights_BT``: detached multipliers of the per-token loss, 0 outside the mask and on
    masked tokens; ``keep_BT``: the tokens the correction keeps in the loss (None: all);
    ``metrics``: detached scalars (``weight_mean``, ``capped_fraction``, ``masked_fraction``,
    ...; fractions of valid tokens, ``*_seq_fraction`` of sequences with a valid token)."""

    weights_BT: Tensor
    keep_BT: Tensor | None
    metrics: dict[str, Tensor]


CorrectionFn = Callable[[Tensor, Tensor, Tensor, CorrectionParams], Correction]
CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")


def rollout_correction(
    name: str,
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    params: CorrectionParams | None = None,
) -> Correction:
    """The correction ``name`` (unknown names fail listing the valid ones), computed without
    gradient."""
    fn = CORRECTIONS.get(name)
    with torch.no_grad():
        return fn(
            old_logprobs_BT.detach(),
            rollout_logprobs_BT.detach(),
            mask_BT.bool(),
            params or CorrectionParams(),
        )


@CORRECTIONS.register("token_tis")
def token_tis(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor, params: CorrectionParams
) -> Correction:
    cap = _cap(params)
    weights_BT = tis_weights(old_logprobs_BT, rollout_logprobs_BT, cap, mask_BT)
    capped_BT = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, mask_BT) > math.log(cap)
    metrics = {
        "weight_mean": masked_mean(weights_BT, mask_BT),
        "capped_fraction": masked_mean(capped_BT.float(), mask_BT),
    }
    return Correction(weights_BT, None, metrics)


@CORRECTIONS.register("seq_tis")
def seq_tis(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor, params: CorrectionParams
) -> Correction:
    cap = _cap(params)
    seq_log_ratio_B = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, mask_BT).sum(-1)
    weight_B = seq_log_ratio_B.clamp(max=_MAX_LOG_RATIO).exp().clamp(max=cap)
    weights_BT = _broadcast(weight_B, mask_BT)
    capped_B = seq_log_ratio_B > math.log(cap)
    metrics = {"weight_mean": masked_mean(weights_BT, mask_BT)}
    metrics |= _fractions("capped", capped_B, mask_BT)
    return Correction(weights_BT, None, metrics)


@CORRECTIONS.register("icepop")
def icepop(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor, params: CorrectionParams
) -> Correction:
    low, high = _bounds(params, ICEPOP_BOUNDS)
    log_ratio_BT = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    ratio_BT = log_ratio_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    keep_BT = mask_BT & (ratio_BT >= low) & (ratio_BT <= high)
    weights_BT = torch.where(keep_BT, ratio_BT, 0.0)
    metrics = {
        "weight_mean": masked_mean(weights_BT, mask_BT),
        "masked_fraction": masked_mean((~keep_BT).float(), mask_BT),
    }
    return Correction(weights_BT, keep_BT, metrics)


@CORRECTIONS.register("geo_mask")
def geo_mask(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor, params: CorrectionParams
) -> Correction:
    low, high = _bounds(params, GEO_MASK_BOUNDS)
    log_ratio_BT = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    geo_log_ratio_B = log_ratio_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)
    keep_B = (geo_log_ratio_B >= math.log(low)) & (geo_log_ratio_B <= math.log(high))
    keep_BT = mask_BT & keep_B[:, None]
    weights_BT = keep_BT.to(old_logprobs_BT.dtype)
    metrics = {"weight_mean": masked_mean(weights_BT, mask_BT)}
    metrics |= _fractions("masked", ~keep_B, mask_BT)
    return Correction(weights_BT, keep_BT, metrics)


def _log_ratio(old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """``old - rollout`` on valid tokens, 0 elsewhere (padding may hold garbage)."""
    return torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0)


def _broadcast(value_B: Tensor, mask_BT: Tensor) -> Tensor:
    return torch.where(mask_BT, value_B[:, None], 0.0)


def _fractions(what: str, flagged_B: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """A per-sequence flag as fractions of valid tokens and of sequences with a valid token."""
    has_tokens_B = mask_BT.any(-1)
    return {
        f"{what}_fraction": masked_mean(flagged_B[:, None].expand_as(mask_BT).float(), mask_BT),
        f"{what}_seq_fraction": masked_mean(flagged_B.float(), has_tokens_B),
    }


def _cap(params: CorrectionParams) -> float:
    cap = TIS_CAP if params.cap is None else params.cap
    if not cap > 0:
        raise ValueError(f"rollout correction cap must be > 0, got {cap}")
    return cap


def _bounds(params: CorrectionParams, defaults: tuple[float, float]) -> tuple[float, float]:
    low = defaults[0] if params.low is None else params.low
    high = defaults[1] if params.high is None else params.high
    if not 0 < low < 1 < high:
        raise ValueError(f"rollout correction bounds need 0 < low < 1 < high, got {low}, {high}")
    return low, high
