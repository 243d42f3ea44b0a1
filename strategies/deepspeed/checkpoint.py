"""Training checkpoints: the DeepSpeed engine state (module, optimizer, LR scheduler) plus every
rank's RNG states, so that loading one into a fresh strategy continues the run exactly."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from roll_ds.checkpoint import load_rng_state, save_rng_state
from strategies.deepspeed.zero import barrier

logger = logging.getLogger(__name__)


def save_engine_checkpoint(
    engine: Any, path: str, tag: str, *, rank: int, global_step: int, is_lora: bool
) -> None:
    """Every rank saves its engine shard and RNG states under ``path/tag`` (a LoRA engine
    leaves out the frozen base)."""
    engine.save_checkpoint(
        path,
        tag=tag,
        client_state={"roll_ds_global_step": global_step},
        exclude_frozen_parameters=is_lora,
    )
    # JSON, fsynced: the driver fsyncs the whole checkpoint again before marking it complete.
    save_rng_state(rng_path(path, tag, rank), cuda=torch.cuda.is_available())
    barrier()


def load_engine_checkpoint(engine: Any, path: str, tag: str, *, rank: int, is_lora: bool) -> None:
    """Load what ``save_engine_checkpoint`` wrote; a missing RNG file only warns."""
    load_path, _ = engine.load_checkpoint(
        path,
        tag=tag,
        load_module_strict=not is_lora,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if load_path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {path}")
    rng_file = rng_path(path, tag, rank)
    if not load_rng_state(rng_file):  # never unpickled: a pickled .pt file is refused
        logger.warning("%s missing: RNG states not restored", rng_file)


def rng_path(path: str, tag: str, rank: int) -> str:
    return os.path.join(path, tag, f"rng_state_rank{rank}.json")
