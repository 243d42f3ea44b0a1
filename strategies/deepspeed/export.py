"""Weights out of a training engine as files: an HF model directory (ZeRO-3 gathered) and,
under LoRA, the peft adapter."""

from __future__ import annotations

import os
from typing import Any

import torch

from roll_ds.models.weights import write_adapter, write_hf_model
from strategies.deepspeed.zero import barrier, release_zero3_params


def export_hf(
    engine: Any,
    module: torch.nn.Module,
    path: str,
    *,
    source_dir: str,
    is_lora: bool,
    is_writer: bool,
    merged: bool = True,
    max_shard_bytes: int = 5 * 2**30,
    base_model: str | None = None,
) -> dict[str, str]:
    """Write an HF model directory plain transformers (and vLLM) load: config, safetensors
    (ZeRO-3 gathered), tokenizer files and generation config of ``source_dir``. Under LoRA also
    ``path/adapter`` (a peft adapter over the base model); ``merged=False`` then skips the full
    weights. The ``is_writer`` rank writes; every rank joins the gathers. ``base_model``: the
    adapter's recorded base (``pretrain`` as configured; ``write_adapter``)."""
    written: dict[str, str] = {}
    if is_writer:
        os.makedirs(path, exist_ok=True)
    if is_lora:
        adapter_dir = os.path.join(path, "adapter")
        release_zero3_params(engine)
        write_adapter(module, adapter_dir, write=is_writer, base_model=base_model)
        written["adapter"] = adapter_dir
    if merged or not is_lora:
        release_zero3_params(engine)
        write_hf_model(
            module,
            path,
            source_dir=source_dir,
            write=is_writer,
            max_shard_bytes=max_shard_bytes,
        )
        written["model"] = path
    barrier()
    return written
