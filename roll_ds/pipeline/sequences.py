"""Pack prompts and sampled responses into the padded tensors the trainer consumes.

Row i is ``prompt_i + response_i`` right-padded to ``T``. Everything per token lives in the
shifted ``[B, T-1]`` space of the trainer's log-probs: column j scores token j+1, so
``response_mask_BT[i, j] = 1`` exactly where token j+1 is a response token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def pack_sequences(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, T]`` and ``response_mask`` ``[B, T-1]``."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    width = max(max(lengths), 2)
    # whole rows as lists, one tensor per column (a tensor per row cost a torch call each)
    ids, attention, response = [], [], []
    for i, (prompt, response_row) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        if not prompt:
            raise ValueError(f"row {i}: empty prompt")
        n_prompt, n = len(prompt), lengths[i]
        pad = width - n
        ids.append([*prompt, *response_row, *[pad_id] * pad])
        attention.append([1] * n + [0] * pad)
        response.append([0.0] * (n_prompt - 1) + [1.0] * (n - n_prompt) + [0.0] * pad)
    return {
        "input_ids": _tensor(ids, np.int64),
        "attention_mask": _tensor(attention, np.int64),
        "response_mask": _tensor(response, np.float32),
    }


def scatter_response_values(
    values: Sequence[Sequence[float]], prompt_lengths: Sequence[int], width: int
) -> torch.Tensor:
    """Per-response-token values (e.g. sampled log-probs) -> ``[B, width-1]``, 0 elsewhere."""
    rows = []
    for i, (row, n_prompt) in enumerate(zip(values, prompt_lengths, strict=True)):
        if not row:
            rows.append([0.0] * (width - 1))
            continue
        start, end = n_prompt - 1, n_prompt - 1 + len(row)
        if start < 0 or end > width - 1:
            raise ValueError(
                f"row {i}: {len(row)} values after a {n_prompt}-token prompt exceed width {width}"
            )
        rows.append([0.0] * start + list(row) + [0.0] * (width - 1 - end))
    if not rows:
        return torch.zeros((0, width - 1), dtype=torch.float32)
    return _tensor(rows, np.float32)


def _tensor(rows: list[list[Any]], dtype: Any) -> torch.Tensor:
    """Equal-length rows as a tensor, through numpy: ``torch.tensor`` of nested lists took 2.5x
    as long (0.47 against 0.18 ms for 128 x 40); a Python float becomes the same float32."""
    return torch.from_numpy(np.array(rows, dtype=dtype))


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, or its EOS where it has none."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id
