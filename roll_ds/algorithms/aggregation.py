"""Loss aggregation modes: how a ``[B, T]`` per-token loss becomes one scalar.

    token-mean               sum over valid tokens / number of valid tokens
    seq-mean-token-mean      mean over each sequence's tokens, then mean over sequences
    seq-mean-token-sum       sum over each sequence's tokens, then mean over sequences
    seq-mean-token-sum-norm  sum over each sequence's tokens / a constant C, then mean over
                             sequences (Dr.GRPO: C = max response length, so no per-length bias)

Sequence means run over sequences with at least one valid token, so rows dropped from the loss
(overlong filtering) do not dilute the mean.

``norm_constant`` (C) is read by ``seq-mean-token-sum-norm`` only; it defaults to the padded
width ``T``, which is constant only when batches are padded to the generation limit, so pass
the configured max response length. Unlike veRL, which *sums* over sequences in this mode, we
average, so the scale does not grow with the batch size (the two differ by a factor B).

``denominator`` replaces the local count (valid tokens for token-mean, non-empty sequences for
the seq-* modes). With micro-batching pass the count of the whole mini-batch so that the summed
micro-batch losses equal the full-batch loss.

Mini-batch normalization. An optimizer step sees ``accumulation x dp`` micro-batches (split over
the data-parallel ranks); the trainer divides each micro-batch's loss by the accumulation steps
and averages gradients over the ranks. ``MiniBatchNorm`` carries the counts of the *whole*
mini-batch (``mini_batch_counts`` per micro-batch, summed over the accumulation window and
all-reduced over the ranks) and the factor ``scale = accumulation x dp`` that undoes that
averaging: ``norm.apply(loss)`` of every micro-batch then sums to the gradient of the loss over
the whole mini-batch, whatever the split. Without it (``norm=None``) a token in a micro-batch of
short responses would weigh more than one in a micro-batch of long ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from roll_ds.algorithms.masks import masked_sum
from roll_ds.registry import Registry


class AggFn(Protocol):
    def __call__(
        self,
        loss_BT: Tensor,
        mask_BT: Tensor,
        norm_constant: float | None,
        denominator: float | None,
    ) -> Tensor: ...


AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")


def _count(counted: Tensor, denominator: float | None) -> Tensor:
    if denominator is not None:
        if denominator <= 0:
            raise ValueError(f"aggregation denominator must be > 0, got {denominator}")
        return torch.as_tensor(denominator, dtype=counted.dtype, device=counted.device)
    return counted.clamp(min=1)


def _num_sequences(mask_BT: Tensor, loss_BT: Tensor, denominator: float | None) -> Tensor:
    nonempty_B = mask_BT.to(loss_BT.dtype).sum(-1) > 0
    return _count(nonempty_B.to(loss_BT.dtype).sum(), denominator)


@AGG_MODES.register("token-mean")
def token_mean(
    loss_BT: Tensor,
    mask_BT: Tensor,
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    return masked_sum(loss_BT, mask_BT) / _count(mask_BT.to(loss_BT.dtype).sum(), denominator)


@AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_BT: Tensor,
    mask_BT: Tensor,
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    tokens_B = mask_BT.to(loss_BT.dtype).sum(-1)
    seq_means_B = masked_sum(loss_BT, mask_BT, dim=-1) / tokens_B.clamp(min=1)
    return seq_means_B.sum() / _num_sequences(mask_BT, loss_BT, denominator)


@AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_BT: Tensor,
    mask_BT: Tensor,
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    return masked_sum(loss_BT, mask_BT) / _num_sequences(mask_BT, loss_BT, denominator)


@AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_BT: Tensor,
    mask_BT: Tensor,
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    constant = loss_BT.shape[-1] if norm_constant is None else norm_constant
    if constant <= 0:
        raise ValueError(f"norm_constant must be > 0, got {constant}")
    return seq_mean_token_sum(loss_BT, mask_BT, denominator=denominator) / constant


SEQUENCE_MODES = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def mini_batch_counts(mask_BT: Tensor) -> Tensor:
    """``[2]`` float64: valid tokens and non-empty sequences of ``mask_BT`` (summed over the
    micro-batches of an optimizer step and the ranks, they make a ``MiniBatchNorm``)."""
    valid_BT = mask_BT.to(torch.float64)
    return torch.stack([valid_BT.sum(), (valid_BT.sum(-1) > 0).to(torch.float64).sum()])


@dataclass(frozen=True)
class MiniBatchNorm:
    """Denominators of one optimizer step's whole mini-batch, and the trainer's averaging
    factor (``gradient_accumulation_steps x data-parallel size``) to undo."""

    tokens: float
    sequences: float
    scale: float = 1.0

    def denominator(self, agg_mode: str) -> float:
        """The count ``agg_mode`` divides by (at least 1: an all-masked mini-batch has a zero
        loss, not a division by zero)."""
        AGG_MODES.check(agg_mode)
        count = self.sequences if agg_mode in SEQUENCE_MODES else self.tokens
        return max(float(count), 1.0)

    def apply(self, loss: Tensor) -> Tensor:
        """The micro-batch loss to hand the trainer (see the module docstring)."""
        return loss * self.scale


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    agg_mode: str = "token-mean",
    *,
    norm_constant: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar with the named mode (see module docstring)."""
    if loss_BT.shape != mask_BT.shape:
        raise ValueError(f"loss {tuple(loss_BT.shape)} and mask {tuple(mask_BT.shape)} differ")
    return AGG_MODES.get(agg_mode)(loss_BT, mask_BT, norm_constant, denominator)
