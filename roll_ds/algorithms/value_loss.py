"""Critic loss for the GAE path: squared error to the returns with PPO value clipping.

v_clipped = old_values + clip(values - old_values, -clip_range, clip_range)
loss      = 0.5 * max((values - returns)^2, (v_clipped - returns)^2)
"""

from __future__ import annotations

import torch
from torch import Tensor

from roll_ds.algorithms.aggregation import aggregate_loss
from roll_ds.algorithms.masks import masked_mean


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    clip_range: float | None = 0.2,
    agg_mode: str = "token-mean",
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar clipped value loss and metrics (``vf_clipfrac``: tokens where the clipped error
    was the larger one, ``vpred_mean``). ``clip_range=None`` disables clipping."""
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"value clip_range must be > 0 (or None to disable), got {clip_range}")
    mask_BT = response_mask_BT.bool()
    error_BT = (values_BT - returns_BT) ** 2
    clipped_active_BT = torch.zeros_like(mask_BT)
    if clip_range is not None:
        v_clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_range, clip_range)
        clipped_error_BT = (v_clipped_BT - returns_BT) ** 2
        clipped_active_BT = clipped_error_BT > error_BT
        error_BT = torch.maximum(error_BT, clipped_error_BT)
    loss = 0.5 * aggregate_loss(
        error_BT, mask_BT, agg_mode, norm_constant=norm_constant, denominator=denominator
    )
    metrics = {
        "vf_clipfrac": masked_mean(clipped_active_BT.float(), mask_BT),
        "vpred_mean": masked_mean(values_BT.detach(), mask_BT),
    }
    return loss, metrics
