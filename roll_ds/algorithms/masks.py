"""Response masks, overlong handling and masked statistics.

Tensors are ``[B, T]`` over response tokens, right-padded; ``mask_BT`` is 1 (or True) on real
response tokens. Masked positions may hold garbage (padding log-probs, NaN): every helper here
selects with ``torch.where`` rather than multiplying, so garbage never leaks into a result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set (mask entries act as weights)."""
    weights = mask.to(values.dtype)
    picked = torch.where(weights != 0, values, torch.zeros((), dtype=values.dtype))
    return (picked * weights).sum() if dim is None else (picked * weights).sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked entries; 0 where nothing is masked in (never NaN)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance over all masked entries; Bessel-corrected when ``unbiased``; 0 for < 2 entries."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """``(values - mean) / sqrt(var + eps)`` over masked entries (veRL convention: unbiased var).

    With ``shift_mean=False`` the mean is added back (scale only). Masked-out entries are 0.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask, unbiased=unbiased) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=whitened.dtype))


def response_mask_from_lengths(lengths_B: Tensor, max_len: int) -> Tensor:
    """``[B, max_len]`` long mask with the first ``lengths_B[b]`` positions set."""
    positions_T = torch.arange(max_len, device=lengths_B.device)
    return (positions_T[None, :] < lengths_B[:, None]).long()


def _is_eos(response_ids_BT: Tensor, eos_token_id: int | Sequence[int]) -> Tensor:
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    eos = torch.tensor(eos_ids, device=response_ids_BT.device, dtype=response_ids_BT.dtype)
    return torch.isin(response_ids_BT, eos)


def response_mask_from_eos(response_ids_BT: Tensor, eos_token_id: int | Sequence[int]) -> Tensor:
    """Mask through the first EOS inclusive; a row without EOS is valid over all ``T`` tokens.

    Assumes responses without EOS were cut at the padded width ``T`` (generation limit); when
    that is not so (stop strings, wider padding) build the mask from lengths instead.
    """
    is_eos_BT = _is_eos(response_ids_BT, eos_token_id).long()
    eos_before_BT = torch.cumsum(is_eos_BT, dim=1) - is_eos_BT  # EOS strictly before t
    return (eos_before_BT == 0).long()


def sequence_lengths(response_mask_BT: Tensor) -> Tensor:
    """Valid response tokens per row, ``[B]`` long."""
    return response_mask_BT.long().sum(-1)


def last_token_index(response_mask_BT: Tensor) -> Tensor:
    """Index of the last valid token per row, ``-1`` for rows with none."""
    positions_T = torch.arange(response_mask_BT.shape[-1], device=response_mask_BT.device)
    return torch.where(response_mask_BT.bool(), positions_T, -1).amax(-1)


def truncated_sequences(
    response_ids_BT: Tensor,
    response_mask_BT: Tensor,
    eos_token_id: int | Sequence[int],
    max_response_length: int | None = None,
) -> Tensor:
    """``[B]`` bool: responses that reached ``max_response_length`` (default ``T``) without EOS.

    Short responses that end without EOS (stop strings) are not truncated. When the rollout
    engine reports ``finish_reason == "length"`` use that instead.
    """
    max_len = response_mask_BT.shape[-1] if max_response_length is None else max_response_length
    last_B = last_token_index(response_mask_BT)
    last_id_B = response_ids_BT.gather(1, last_B.clamp(min=0)[:, None]).squeeze(1)
    ends_with_eos_B = (last_B >= 0) & _is_eos(last_id_B, eos_token_id)
    return (sequence_lengths(response_mask_BT) >= max_len) & ~ends_with_eos_B


def mask_truncated(response_mask_BT: Tensor, truncated_B: Tensor) -> Tensor:
    """Overlong filtering (DAPO): drop truncated responses from the loss by zeroing their rows.

    Apply to the *loss* mask only; rewards and advantages keep the original mask.
    """
    keep_B = ~truncated_B.bool()
    return response_mask_BT * keep_B[:, None].to(response_mask_BT.dtype)


def overlong_soft_penalty(
    lengths_B: Tensor, max_response_length: int, buffer: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment, ``[B]`` float in ``[-penalty_factor, 0]``, added to scores.

    0 up to ``max_response_length - buffer`` tokens, then linear down to ``-penalty_factor`` at
    ``max_response_length`` (and beyond).
    """
    if not 0 < buffer <= max_response_length:
        raise ValueError(
            f"overlong buffer must be in (0, max_response_length={max_response_length}], "
            f"got {buffer}"
        )
    excess_B = lengths_B.to(torch.float32) - (max_response_length - buffer)
    return -penalty_factor * (excess_B / buffer).clamp(min=0.0, max=1.0)
