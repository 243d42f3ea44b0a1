"""Training checkpoints: the DeepSpeed engine state (module, optimizer, LR scheduler) plus every
rank's RNG states, so that loading one into a fresh strategy continues the run exactly.

A checkpoint is laid out for the ZeRO stage of the engine that saved it (``engine.json`` records
it); loading it into an engine of another stage is refused with the setting to change, before
DeepSpeed fails on the layout (a LoRA ZeRO-3 config may run at stage 2: ``zero3_adapter_stage``).
"""

from __future__ import annotations

import json
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
    if rank == 0:
        with open(layout_path(path, tag), "w") as f:
            json.dump({"zero_stage": engine.zero_optimization_stage()}, f)
    barrier()


def check_layout(engine: Any, path: str, tag: str) -> None:
    """Refuse a checkpoint saved by an engine of another ZeRO stage, naming the fix."""
    file = layout_path(path, tag)
    if not os.path.isfile(file):  # saved before engine.json existed: DeepSpeed checks alone
        return
    with open(file) as f:
        saved = json.load(f)["zero_stage"]
    stage = engine.zero_optimization_stage()
    if saved != stage:
        lora = (
            f" and, for LoRA under ZeRO-3, strategy_config.zero3_adapter_stage: {saved} (a whole "
            "frozen base trains its adapter at stage 1 by default, 2 before)"
            if saved in (1, 2, 3)
            else ""
        )
        raise ValueError(
            f"checkpoint {os.path.join(path, tag)} was saved by a ZeRO stage-{saved} engine, "
            f"but this run builds a stage-{stage} engine, whose layout differs. Resume with "
            f"the settings it was saved under: the ZeRO preset (strategy_config){lora}"
        )


def load_engine_checkpoint(engine: Any, path: str, tag: str, *, rank: int, is_lora: bool) -> None:
    """Load what ``save_engine_checkpoint`` wrote; a missing RNG file only warns."""
    check_layout(engine, path, tag)
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


def layout_path(path: str, tag: str) -> str:
    return os.path.join(path, tag, "engine.json")


def rng_path(path: str, tag: str, rank: int) -> str:
    return os.path.join(path, tag, f"rng_state_rank{rank}.json")
