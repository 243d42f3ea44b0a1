"""Load an HF causal LM for a role: dtype, attention implementation, optional ZeRO-3 sharded
construction, LoRA through peft.

``pretrain`` values of the form ``embedded:<name>`` are the tiny models shipped with the package
(``roll_ds/models/shipped.py``); anything else is a local directory or a hub id that transformers
resolves itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from roll_ds.config.schema import ATTN_IMPLEMENTATIONS
from roll_ds.models.shipped import EMBEDDED_PREFIX, resolve_embedded

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel


def resolve_model_path(name_or_path: str) -> str:
    """A directory or hub id transformers can load; ``embedded:*`` is its shipped directory."""
    if name_or_path.startswith(EMBEDDED_PREFIX):
        return resolve_embedded(name_or_path)
    return name_or_path


def attn_implementation(name: str | None) -> str | None:
    if name not in ATTN_IMPLEMENTATIONS:
        valid = ", ".join(str(k) for k in ATTN_IMPLEMENTATIONS if k)
        raise ValueError(f"unknown attn_implementation {name!r}; valid: {valid} or null")
    return ATTN_IMPLEMENTATIONS[name]


def load_with_head(
    auto_cls: Any,
    path: str,
    config: Any,
    *,
    dtype: str,
    attn_impl: str | None,
    zero3_config: Mapping[str, Any] | None,
    no_head: str,
) -> PreTrainedModel:
    """``auto_cls.from_pretrained(path)`` with ``config``, the role's dtype and attention, built
    ZeRO-3 partitioned under a stage-3 ``zero3_config``. An architecture transformers has no
    such head for fails naming the model and ``no_head`` (what to do instead)."""
    from roll_ds.models.tensors import torch_dtype

    kwargs: dict[str, Any] = {"config": config, "dtype": torch_dtype(dtype)}
    impl = attn_implementation(attn_impl)
    if impl is not None:
        kwargs["attn_implementation"] = impl
    try:
        with zero3_construction(zero3_config):
            return auto_cls.from_pretrained(path, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ValueError(
            f"the architecture of {path} ({type(config).__name__}) has no {auto_cls.__name__} "
            f"head in transformers; {no_head}"
        ) from None


@contextlib.contextmanager
def zero3_construction(ds_config: Mapping[str, Any] | None) -> Iterator[None]:
    """While active, ``from_pretrained`` builds the model already partitioned by ZeRO-3
    (``deepspeed.zero.Init`` through transformers' ``HfDeepSpeedConfig``), so no rank ever holds
    the full model. A no-op for ``None`` or a config below stage 3."""
    stage = int(((ds_config or {}).get("zero_optimization") or {}).get("stage", 0))
    if stage != 3:
        yield
        return
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        unset_hf_deepspeed_config,
    )

    keep_alive = HfDeepSpeedConfig(dict(ds_config))  # transformers holds only a weakref
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del keep_alive


def load_causal_lm(
    path: str,
    *,
    dtype: str = "fp32",
    attn_impl: str | None = None,
    zero3_config: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` with roll_ds's dtype / attention names.

    With a stage-3 ``zero3_config`` the model is constructed partitioned (see
    ``zero3_construction``); every rank of the data-parallel group must call this together.
    """
    from transformers import AutoModelForCausalLM

    from roll_ds.models.tensors import torch_dtype

    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code}
    impl = attn_implementation(attn_impl)
    if impl is not None:
        kwargs["attn_implementation"] = impl
    with zero3_construction(zero3_config):
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), **kwargs)
    return model


def lora_target_modules(target: str) -> str | list[str]:
    """``"all-linear"`` (every linear layer but the output head) or a comma list of names."""
    target = target.strip()
    if target == "all-linear":
        return "all-linear"
    names = [t.strip() for t in target.split(",") if t.strip()]
    if not names:
        raise ValueError("model_args.lora_target is empty; use 'all-linear' or 'q_proj,v_proj'")
    return names


def lora_config(
    *,
    rank: int,
    alpha: int | None = None,
    dropout: float = 0.0,
    target: str = "all-linear",
    field: str = "model_args",
    **extra: Any,
) -> Any:
    """peft ``LoraConfig`` from roll_ds's model_args fields (alpha defaults to ``2 * rank``);
    ``field`` names the config section in errors, ``extra`` goes to ``LoraConfig`` as is."""
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"{field}.lora_rank must be >= 1, got {rank}")
    return LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=dropout,
        target_modules=lora_target_modules(target),
        bias="none",
        **extra,
    )


def apply_lora(model: PreTrainedModel, **lora_args: Any) -> PeftModel:
    """Wrap ``model`` with a peft LoRA adapter named ``default`` (``lora_args`` as for
    ``lora_config``); only adapter params train."""
    from peft import TaskType, get_peft_model

    return get_peft_model(model, lora_config(task_type=TaskType.CAUSAL_LM, **lora_args))


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and total parameter counts (ZeRO-3 aware: partitioned params count fully)."""
    total = trainable = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        trainable += n if p.requires_grad else 0
    return {"total": total, "trainable": trainable}
