"""Pack prompts and sampled responses into the padded tensors the trainer consumes.

Row i is ``prompt_i + response_i`` right-padded to ``T``. Everything per token lives in the
shifted ``[B, T-1]`` space of the trainer's log-probs: column j scores token j+1, so
``response_mask_BT[i, j] = 1`` exactly where token j+1 is a response token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def pack_sequences(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, T]`` and ``response_mask`` ``[B, T-1]``."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    width = max(max(lengths), 2)
    batch = len(lengths)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    response_mask = torch.zeros((batch, width - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        if not prompt:
            raise ValueError(f"row {i}: empty prompt")
        n_prompt, n = len(prompt), lengths[i]
        input_ids[i, :n] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention_mask[i, :n] = 1
        response_mask[i, n_prompt - 1 : n - 1] = 1.0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
    }


def scatter_response_values(
    values: Sequence[Sequence[float]], prompt_lengths: Sequence[int], width: int
) -> torch.Tensor:
    """Per-response-token values (e.g. sampled log-probs) -> ``[B, width-1]``, 0 elsewhere."""
    out = torch.zeros((len(values), width - 1), dtype=torch.float32)
    for i, (row, n_prompt) in enumerate(zip(values, prompt_lengths, strict=True)):
        if row:
            out[i, n_prompt - 1 : n_prompt - 1 + len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, or its EOS where it has none."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id
