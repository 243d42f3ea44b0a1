"""What ``DeepSpeedTrainStrategy.initialize`` builds before the engine: the seeds, the DeepSpeed
config (``"auto"`` values filled from the training args) and the model (a causal LM, or the value
model for ``head="value"``), optionally with LoRA adapters.

Under ZeRO-3 a LoRA model's frozen base is either partitioned with the rest (built partitioned)
or, with ``zero3_frozen_base`` resolved to ``whole`` (``roll_ds.config.deepspeed``; ``auto`` does
so when the base fits a quarter of a rank's memory), loaded whole on every rank and kept out of
ZeRO-3 (``roll_ds.models.frozen_base``): only the adapter is left to ZeRO, whose built config
then says stage 1 (optimizer states partitioned; 2 with the optimizer offloaded: gradients
too), or 3 with ``zero3_adapter_stage: 3`` (the adapter's weights partitioned too)."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from roll_ds.config.deepspeed import (
    DeepSpeedInputs,
    build_deepspeed_config,
    fp16_train_problems,
    frozen_base_whole,
    nvme_paths,
    zero_stage,
)
from roll_ds.config.schema import ModelArgs, TrainingArgs
from roll_ds.config.zeropp import zeropp_keys
from roll_ds.models.frozen_base import keep_frozen_base_whole
from roll_ds.models.loading import apply_lora, load_causal_lm
from roll_ds.models.value_model import apply_value_lora, load_value_model
from roll_ds.platform import current_platform
from strategies.deepspeed import nvme
from strategies.deepspeed.optimizer import fill_optimizer_auto

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_train_ds_config(
    strategy_config: Mapping[str, Any],
    *,
    model_path: str,
    model_args: ModelArgs,
    training_args: TrainingArgs,
    dp_size: int,
    nvme_dir: str | None = None,
) -> dict[str, Any]:
    """The engine's DeepSpeed config: ``strategy_config`` with its ``"auto"`` values (the
    optimizer section's too) filled from ``training_args`` for ``dp_size`` ranks; an ``"auto"``
    ``nvme_path`` is ``nvme_dir``, whose room and libaio are checked here too (this rank's node
    may not be the machine that validated the config)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path)
    source = dict(strategy_config)
    if "optimizer" in source:  # DeepSpeed builds it; its "auto" params come from training_args
        source["optimizer"] = fill_optimizer_auto(source["optimizer"], training_args)
    lora = model_args.lora_rank is not None
    base_bytes, adapter = lora_sizes(hf_config, model_args) if lora else (None, None)
    size = nvme.model_size(model_path) if nvme_paths(source) else None
    cfg = build_deepspeed_config(
        source,
        DeepSpeedInputs(
            micro_batch_size=training_args.per_device_train_batch_size,
            gradient_accumulation_steps=training_args.gradient_accumulation_steps,
            dp_size=dp_size,
            max_grad_norm=training_args.max_grad_norm,
            dtype=model_args.dtype,
            hidden_size=getattr(hf_config, "hidden_size", None),
            lora=lora,
            frozen_base_bytes=base_bytes,
            rank_memory_bytes=rank_memory_bytes(),
            trainable_numel=adapter,
            nvme_dir=nvme_dir,
            largest_numel=size.largest_numel if size else None,
        ),
    )
    if (cfg.get("fp16") or {}).get("enabled"):
        require_fp16_support("fp16 training")
        problems = fp16_train_problems(cfg, "strategy_config")
        if problems:
            raise ValueError("\n".join(problems))
    if zeropp_keys(cfg) and not current_platform().is_cuda:
        raise ValueError(
            f"{', '.join(zeropp_keys(cfg))} (ZeRO++) need CUDA GPUs (DeepSpeed's quantizers "
            "are CUDA kernels); remove them from the strategy_config"
        )
    nvme.check_rank_nvme(
        cfg,
        size=size,
        trained_numel=adapter if lora else None,
        dtype=model_args.dtype,
        dp_size=dp_size,
    )
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10**9)
    return cfg


def require_fp16_support(what: str) -> None:
    """Raise unless DeepSpeed's accelerator here runs fp16: its engine refuses fp16 ("Type fp16
    is not supported on your device") wherever ``is_fp16_supported()`` is false. On CPU that
    asks oneDNN for fp16 kernels (AVX512-FP16 or AMX-FP16, e.g. Intel Sapphire Rapids and
    later); torch itself computes fp16 on any CPU, and DeepSpeed's fp16 path with dynamic loss
    scaling then runs (tests force the query to exercise it), but the engine will not start."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return
    name = accelerator.device_name()
    why = (
        "oneDNN has no fp16 kernels on this CPU: torch.ops.mkldnn._is_mkldnn_fp16_supported() is "
        "False; it needs AVX512-FP16 or AMX-FP16"
        if name == "cpu"
        else f"the {name} device reports no fp16"
    )
    raise ValueError(
        f"{what}: DeepSpeed's {name} accelerator refuses fp16 here (is_fp16_supported() is "
        f"False: {why}); set model_args.dtype: bf16 or fp32"
    )


def load_train_model(
    model_path: str, model_args: ModelArgs, ds_config: Mapping[str, Any], *, head: str
) -> torch.nn.Module:
    """The model to train (ZeRO-3 partitioned construction under a stage-3 ``ds_config``),
    gradient checkpointing on unless disabled, LoRA-wrapped when ``model_args.lora_rank`` is
    set."""
    args = model_args
    load, wrap = (
        (load_value_model, apply_value_lora) if head == "value" else (load_causal_lm, apply_lora)
    )
    whole = args.lora_rank is not None and frozen_base_whole(ds_config)
    model = load(
        model_path,
        dtype=args.dtype,
        attn_impl=args.attn_implementation,
        zero3_config=None if whole else ds_config,
    )
    if not args.disable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank is not None:
        model = wrap(
            model,
            rank=args.lora_rank,
            alpha=args.lora_alpha,
            dropout=args.lora_dropout,
            target=args.lora_target,
        )
    if whole:
        moved = keep_frozen_base_whole(model, torch.device(current_platform().device(local_rank())))
        logger.info(
            "ZeRO-3 config: %d frozen base weights kept whole, out of partitioning; the adapter "
            "trains at ZeRO stage %d (zero3_adapter_stage)",
            moved,
            zero_stage(ds_config),
        )
    return model


def lora_sizes(hf_config: Any, model_args: ModelArgs) -> tuple[int | None, int | None]:
    """The bytes of ``hf_config``'s causal LM at ``model_args.dtype`` (the frozen base) and the
    parameters of the LoRA adapter ``model_args`` asks for, counted on one meta-device build
    (nothing allocated); None for what cannot be built."""
    from transformers import AutoModelForCausalLM

    from roll_ds.models.loading import apply_lora
    from roll_ds.models.tensors import torch_dtype

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # an architecture without a causal-LM class, remote code, ...
        logger.warning("model size unknown (%s): the frozen base stays partitioned", exc)
        return None, None
    numel = sum(p.numel() for p in model.parameters())  # a tied weight counted once
    base_bytes = numel * torch.empty((), dtype=torch_dtype(model_args.dtype)).element_size()
    try:
        with torch.device("meta"):
            peft_model = apply_lora(
                model,
                rank=model_args.lora_rank,
                alpha=model_args.lora_alpha,
                dropout=model_args.lora_dropout,
                target=model_args.lora_target,
            )
    except Exception as exc:  # a target peft cannot match, ...
        logger.warning("adapter size unknown (%s): reduce buckets stay hidden x hidden", exc)
        return base_bytes, None
    return base_bytes, sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_memory_bytes() -> int | None:
    """One rank's memory: its GPU's, or on CPU the host's divided among the local ranks."""
    if current_platform().is_cuda and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    return host // max(1, local)
