"""Torch helpers the core's model loading and forward passes share with every backend: the
torch dtype of a config's ``dtype`` name, and position ids of a left-padded batch."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def position_ids_from_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... counted over real tokens only, so left padding does not shift positions
    (what vLLM sees for the same unpadded sequence). Padding positions get 0."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)
