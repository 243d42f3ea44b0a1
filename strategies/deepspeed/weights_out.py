"""What leaves a ``deepspeed_train`` engine as weights: the buckets a weight sync sends to the
rollout engines (full, LoRA merged, or the adapter alone), their size (the sync's time bound
scales with it) and a Hugging Face export. Every method is collective under ZeRO-3 (each rank
joins the gathers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from roll_ds.models.weights import (
    adapter_config,
    iter_adapter_buckets,
    iter_weight_buckets,
    sync_numels,
)
from strategies.deepspeed import export
from strategies.deepspeed.zero import release_zero3_params


class WeightsOut:
    """Mixed into ``DeepSpeedTrainStrategy`` (``train.py``), whose ``engine``, ``module``,
    ``is_lora``, ``model_path``, ``rank`` and ``_require_head`` it reads."""

    engine: Any
    module: torch.nn.Module
    is_lora: bool
    model_path: str
    rank: int

    def named_weights_for_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights under HF names in buckets of at most ``bucket_bytes`` (every rank gets
        every bucket); LoRA merged, a tied embedding also as ``lm_head.weight``."""
        self._require_head("lm", "weight sync")
        release_zero3_params(self.engine)
        return iter_weight_buckets(self.module, bucket_bytes)

    def adapter_buckets_for_sync(
        self, bucket_bytes: int
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The LoRA adapter alone (``weight_sync.lora_sync: adapter``), under the names peft
        saves it with, in buckets of at most ``bucket_bytes``: the rollout engine keeps the
        frozen base weights it loaded and serves base + adapter."""
        self._require_head("lm", "weight sync")
        if not self.is_lora:
            raise ValueError(
                "weight_sync.lora_sync=adapter needs a LoRA policy (actor_train.model_args."
                "lora_rank); use lora_sync=merged for full fine-tuning"
            )
        release_zero3_params(self.engine)
        return iter_adapter_buckets(self.module, bucket_bytes)

    def adapter_config(self) -> dict[str, Any]:
        """The policy's peft ``LoraConfig`` as ``adapter_config.json`` content."""
        return adapter_config(self.module)

    def sync_numels(self, adapter_only: bool) -> dict[torch.dtype, int]:
        """Elements by dtype a sync sends (the weight sync's bound scales with its bytes)."""
        return sync_numels(self.module, adapter_only=adapter_only)

    def export_hf(
        self,
        path: str,
        *,
        merged: bool = True,
        max_shard_bytes: int = 5 * 2**30,
    ) -> dict[str, str]:
        """Write an HF model directory (``export.export_hf``); under LoRA also ``path/adapter``,
        and ``merged=False`` then skips the full weights. Rank 0 writes; every rank joins the
        gathers."""
        return export.export_hf(
            self.engine,
            self.module,
            path,
            source_dir=self.model_path,
            is_lora=self.is_lora,
            is_writer=self.rank == 0,
            merged=merged,
            max_shard_bytes=max_shard_bytes,
            base_model=getattr(self, "base_model", None),
        )
