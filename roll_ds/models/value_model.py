"""The critic's model: the pretrain's transformer body with a scalar value head.

As veRL's critic: ``AutoModelForTokenClassification`` with ``num_labels=1`` (for Qwen2
``Qwen2ForTokenClassification``), the body loaded from the causal-LM checkpoint, the head
(``score``; ``classifier`` on some architectures) freshly initialised, dropout off. The
checkpoint's ``lm_head`` is not used.

``values_BT`` has the log-probs' layout (``[B, T-1]``): column ``t`` is the value of the state
after token ``t``, the one in which token ``t + 1`` is chosen, so it lines up with
``logprobs_BT`` column ``t`` and with the response mask.

Under LoRA the body gets adapters and the head trains in full. It trains in place (its
``requires_grad`` set after peft froze the base) rather than as a peft ``modules_to_save`` copy,
which would deep-copy a ZeRO-3 partitioned parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from roll_ds.models.loading import load_with_head, lora_config, resolve_model_path
from roll_ds.models.tensors import position_ids_from_mask

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

HEAD_NAMES = ("score", "classifier")


def load_value_model(
    path: str,
    *,
    dtype: str = "fp32",
    attn_impl: str | None = None,
    zero3_config: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """The value model of ``path`` (a causal-LM checkpoint); ZeRO-3 partitioned construction
    with a stage-3 ``zero3_config`` (every rank calls this together)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = resolve_model_path(path)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # values must not be noisy (the default is 0.1)
    return load_with_head(
        AutoModelForTokenClassification,
        path,
        config,
        dtype=dtype,
        attn_impl=attn_impl,
        zero3_config=zero3_config,
        no_head="critic: it cannot be a value model; point critic.model_args.model_name_or_path "
        "at a supported model",
    )


def head_name(model: torch.nn.Module) -> str:
    """Attribute name of the value head of a (not peft-wrapped) token-classification model."""
    for name in HEAD_NAMES:
        if hasattr(model, name):
            return name
    raise ValueError(f"{type(model).__name__} has no value head (looked for {HEAD_NAMES})")


def apply_value_lora(model: PreTrainedModel, **lora_args: Any) -> PeftModel:
    """LoRA adapters (named ``default``) on the body; the value head stays fully trainable.
    ``lora_args`` as for ``roll_ds.models.loading.lora_config``."""
    from peft import get_peft_model

    head = head_name(model)
    # "all-linear" would otherwise put an adapter on the head
    config = lora_config(field="critic.model_args", exclude_modules=[head], **lora_args)
    peft_model = get_peft_model(model, config)
    for param in getattr(model, head).parameters():
        param.requires_grad_(True)
    return peft_model


def forward_values(
    model: Any, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> torch.Tensor:
    """``values_BT`` (``[B, T-1]``, fp32) of a value model (module, DeepSpeed engine or peft
    model); gradients flow when the caller has them enabled."""
    out = model(
        input_ids=input_ids_BT,
        attention_mask=attention_mask_BT,
        position_ids=position_ids_from_mask(attention_mask_BT),
        use_cache=False,
    )
    return out.logits[:, :-1, 0].float()
