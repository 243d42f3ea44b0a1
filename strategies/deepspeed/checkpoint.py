"""Training checkpoints: the DeepSpeed engine state (module, optimizer, LR scheduler) plus every
rank's RNG states, so that loading one into a fresh strategy continues the run exactly.

A checkpoint is laid out for the ZeRO stage and the data-parallel size of the engine that saved
it. ``engine.json`` records both, and the DeepSpeed files the ranks wrote (so the driver can tell
a partial checkpoint before any actor starts: ``roll_ds.pipeline.save_resume``). Loading it into
an engine of another stage is refused with the setting to change, before DeepSpeed fails on the
layout (a LoRA ZeRO-3 config may run at stage 2: ``zero3_adapter_stage``). Loading it into an
engine of another data-parallel size goes through a universal checkpoint (``universal``),
converted once by the driver before the trainers start.

RNG states on another size: rank ``r`` restores ``rng_state_rank<r>.json`` where the checkpoint
has one, and rank 0's otherwise (a grown role's new ranks). Every rank is seeded alike
(``seed_everything(seed)``), so the files are equal wherever the ranks drew alike and a new
rank continues the stream it would have had; but a sample now lands on another rank or micro
batch than in the uninterrupted run, so dropout masks (the only per-rank randomness in training)
are not that run's. The resume is deterministic, not exact.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from roll_ds.checkpoint import (
    load_rng_state,
    missing_engine_files,
    read_engine_record,
    save_rng_state,
    write_engine_record,
)
from strategies.deepspeed import universal
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
    barrier()  # every rank's files are written: rank 0 lists them
    if rank == 0:  # roll_ds.checkpoint's engine record, plus the stage
        directory = os.path.join(path, tag)
        layout = {
            "zero_stage": engine.zero_optimization_stage(),
            "world_size": engine.world_size,
            "dp_world_size": engine.dp_world_size,
            # the global batch a resume on another size keeps (roll_ds.pipeline.resume_batch)
            "per_device_train_batch_size": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "files": sorted(f for f in os.listdir(directory) if f.endswith(".pt")),
        }
        write_engine_record(directory, layout)
    barrier()


def check_layout(engine: Any, layout: dict[str, Any] | None, path: str, tag: str) -> None:
    """Refuse a checkpoint saved by an engine of another ZeRO stage, naming the fix."""
    if layout is None:
        return
    saved = layout["zero_stage"]
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
    """Load what ``save_engine_checkpoint`` wrote, through a universal checkpoint when it was
    saved on another data-parallel size; a missing RNG file only warns."""
    record = read_engine_record(os.path.join(path, tag))  # None: older; DeepSpeed checks alone
    check_layout(engine, record, path, tag)
    # (a record of before the sizes were in it: today's path, where DeepSpeed names a change)
    saved_dp = (record or {}).get("dp_world_size")
    resized = saved_dp is not None and saved_dp != engine.dp_world_size
    load_tag, loading = tag, contextlib.nullcontext()
    if resized:
        assert record is not None
        load_tag = _universal_tag(engine, record, path, tag, rank=rank)
        loading = universal.universal_loading(engine)
    with loading:
        load_path, _ = engine.load_checkpoint(
            path,
            tag=load_tag,
            load_module_strict=not is_lora,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
    if load_path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {load_tag!r} under {path}")
    if resized and engine.zero_optimization_stage() == 3:
        universal.repair_stage3_load(engine, path, load_tag)
    rng_file = rng_path(path, tag, rank)
    if resized and not os.path.isfile(rng_file):  # a new rank: rank 0's (module docstring)
        rng_file = rng_path(path, tag, 0)
    if not load_rng_state(rng_file):  # never unpickled: a pickled .pt file is refused
        logger.warning("%s missing: RNG states not restored", rng_file)


def _universal_tag(engine: Any, record: dict[str, Any], path: str, tag: str, *, rank: int) -> str:
    """The tag of ``path/tag`` as a universal checkpoint (converted unless it was before),
    after checking the saved ranks' files are all there."""
    saved, now = record["dp_world_size"], engine.dp_world_size
    missing = missing_engine_files(os.path.join(path, tag), record)
    if missing:
        raise FileNotFoundError(
            f"{os.path.join(path, tag)} lacks {', '.join(missing)}: a checkpoint saved on "
            f"{saved} ranks resumes on {now} only from every saved rank's shard; resume from "
            f"a complete checkpoint, or on {saved} ranks"
        )
    if rank == 0:
        logger.info(
            "%s was saved on %d data-parallel ranks, this engine has %d: loading it as a "
            "universal checkpoint",
            os.path.join(path, tag),
            saved,
            now,
        )
    return universal.converted_tag(path, tag)


def rng_path(path: str, tag: str, rank: int) -> str:
    return os.path.join(path, tag, f"rng_state_rank{rank}.json")
