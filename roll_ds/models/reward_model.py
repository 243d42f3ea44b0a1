"""Discriminative reward models: load one with its scoring head, and score whole sequences.

Two heads, both a scalar read at the sequence's last token:

- ``sequence_classification``: ``AutoModelForSequenceClassification`` with ``num_labels=1``, the
  usual format of trained reward models (for Qwen2 ``Qwen2ForSequenceClassification``; its head
  is ``score``). A checkpoint trained as such loads with its head; a plain causal-LM checkpoint
  gets a fresh head (transformers warns about it).
- ``value``: the project's value model (``roll_ds/models/value_model.py``, a token-classification
  head as the critic uses), read at the last token.

Sequences are left-padded with position ids counted over real tokens, so the last column is
every row's last real token, whatever its length; the same layout ``compute_logprobs`` uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from roll_ds.models.loading import load_with_head, resolve_model_path

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

HEADS = ("sequence_classification", "value")


def check_head(head: str) -> str:
    if head not in HEADS:
        raise ValueError(f"unknown reward model head {head!r}; valid: {', '.join(HEADS)}")
    return head


def load_reward_model(
    path: str,
    head: str,
    *,
    dtype: str = "fp32",
    attn_impl: str | None = None,
    zero3_config: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """The reward model of ``path`` with ``head``; ZeRO-3 partitioned construction with a
    stage-3 ``zero3_config`` (every rank calls this together)."""
    check_head(head)
    if head == "value":
        from roll_ds.models.value_model import load_value_model

        return load_value_model(path, dtype=dtype, attn_impl=attn_impl, zero3_config=zero3_config)
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = resolve_model_path(path)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    if getattr(config, "pad_token_id", None) is None:
        # HF pools at the rightmost non-pad token and needs a pad id for batches; left padding
        # puts every row's last real token last, so any id that never ends a sequence works.
        config.pad_token_id = getattr(config, "eos_token_id", None) or 0
    return load_with_head(
        AutoModelForSequenceClassification,
        path,
        config,
        dtype=dtype,
        attn_impl=attn_impl,
        zero3_config=zero3_config,
        no_head="reward model: use head: value or another model",
    )


def forward_scores(
    model: Any, head: str, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> torch.Tensor:
    """``scores_B`` (fp32): the head's output at each left-padded row's last token."""
    from roll_ds.models.tensors import position_ids_from_mask

    out = model(
        input_ids=input_ids_BT,
        attention_mask=attention_mask_BT,
        position_ids=position_ids_from_mask(attention_mask_BT),
        use_cache=False,
    )
    if head == "value":
        return out.logits[:, -1, 0].float()
    return out.logits[:, 0].float()  # already pooled at the rightmost non-pad token


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids_BT, attention_mask_BT)`` of token lists, left-padded to the longest."""
    import torch

    width = max((len(s) for s in sequences), default=1)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq) :] = 1
    return ids, mask
