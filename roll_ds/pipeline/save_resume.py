"""Checkpoints of a run and resuming from one.

A checkpoint holds each trained role's engine state (``<role>/``, DeepSpeed tag ``engine``),
the episodes played ahead (``async_generation``), what ``python -m roll_ds.export`` needs
besides the engine state, and the driver's state: step, prompt sampler, RNG. The directory
layout, rotation and ``best`` are ``roll_ds.checkpoint``'s.

``check_resume`` reads the checkpoint before any actor starts: the trained roles' directories and
the files their engine records (``engine.json``) list must be there, so a partial copy fails
naming what it lacks instead of inside a worker. A role resumed on another data-parallel size
than it was saved on is loaded by its strategy from a universal checkpoint, converted once
(DeepSpeed: ``strategies/deepspeed/universal.py``); that needs every saved rank's shard, and
keeps the role's global batch (``resume_batch``: ``gradient_accumulation_steps`` rescaled, or a
clear error).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from roll_ds.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    missing_engine_files,
    read_engine_record,
    restore_rng_state,
)
from roll_ds.config.checks.pipeline import train_batch_problems
from roll_ds.config.role_placement import placement
from roll_ds.config.schema import RLVRConfig
from roll_ds.data.sampler import PromptSampler
from roll_ds.export import ExportInfo
from roll_ds.pipeline.model_roles import TrainingRole
from roll_ds.pipeline.resume_batch import keep_global_batch
from roll_ds.pipeline.rollout_queue import RolloutQueue
from roll_ds.tracking import ROLLOUTS_FILE, truncate_jsonl_after

logger = logging.getLogger(__name__)

ENGINE_TAG = "engine"  # each trained role's engine state: <checkpoint>/<role>/engine/


def save_run_checkpoint(
    step: int,
    *,
    cfg: RLVRConfig,
    checkpoints: CheckpointManager,
    trainers: Mapping[str, TrainingRole],
    roles: Sequence[str],
    sampler: PromptSampler | None,
    queue: RolloutQueue | None,
    model_dir: str,
    run_id: str | None = None,
) -> Path:
    """Save checkpoint ``step`` of the trained ``roles``; returns its committed directory.
    ``run_id``: the tracker's run id, which a resume passes back (one W&B run)."""
    partial = checkpoints.begin(step)
    saves = [trainers[n].save_checkpoint(str(partial / n), ENGINE_TAG) for n in roles]
    for call in saves:
        call.get()
    if queue is not None:  # the batches generated ahead train after a resume too
        queue.save(partial)
    # What `python -m roll_ds.export` needs besides the engine state (base model, LoRA).
    ExportInfo.from_config(cfg, model_dir).save(partial)
    state = {
        "step": step,
        "sampler": sampler.state_dict() if sampler is not None else {},
        "rng": capture_rng_state(),
        "exp_name": cfg.exp_name,
        "run_id": run_id,
    }
    return checkpoints.commit(partial, state)


def resume_run(
    which: str,
    *,
    checkpoints: CheckpointManager,
    trainers: Mapping[str, TrainingRole],
    roles: Sequence[str],
    sampler: PromptSampler | None,
    queue: RolloutQueue | None,
    out_dir: Path,
) -> int:
    """Load checkpoint ``which`` (``resume_from_checkpoint``: a path or ``latest``) into the
    trained ``roles``, the sampler, the queue and the RNG; returns its step."""
    path = checkpoints.resolve(which)
    state = checkpoints.load_state(path)
    loads = [trainers[n].load_checkpoint(str(path / n), ENGINE_TAG) for n in roles]
    for call in loads:
        call.get()
    if sampler is not None:  # environments draw their seeds from (seed, step): no state
        sampler.load_state_dict(state["sampler"])
    if queue is not None:
        queue.load(path)
    restore_rng_state(state["rng"])
    step = int(state["step"])
    # The resumed run dumps the later steps' rollouts again (metrics: Tracker(resume_step=)).
    truncate_jsonl_after(out_dir / ROLLOUTS_FILE, step)
    logger.info("resumed from %s at step %d", path, step)
    return step


def checkpoint_run_id(checkpoints: CheckpointManager, which: str) -> str | None:
    """The tracker run id checkpoint ``which`` kept (None: saved before ids were kept)."""
    return checkpoints.load_state(checkpoints.resolve(which)).get("run_id")


def check_resume(cfg: RLVRConfig, checkpoints: CheckpointManager, roles: Sequence[str]) -> Path:
    """The checkpoint ``cfg.resume_from_checkpoint`` names, checked before any actor starts:
    every trained role's engine directory with every file its record lists. A role resumed on
    another size gets the ``gradient_accumulation_steps`` that keeps its global batch (``cfg``
    is changed in place). Returns the checkpoint's path."""
    assert cfg.resume_from_checkpoint, "only a resuming run is checked"
    path = checkpoints.resolve(cfg.resume_from_checkpoint)
    for name in roles:
        directory = path / name / ENGINE_TAG
        if not directory.is_dir():
            raise FileNotFoundError(
                f"resume_from_checkpoint: {path} has no {name}/{ENGINE_TAG}/ state (saved by a "
                f"run without the {name} role?)"
            )
        record = read_engine_record(directory)
        if record is None:  # an older checkpoint: its strategy checks what it loads
            continue
        saved = record.get("dp_world_size")
        role = getattr(cfg, name)
        world = placement(name, role).world_size
        # Ulysses ranks share a sample: the data-parallel size is what the partitions follow
        dp = world // max(1, getattr(role, "sequence_parallel_size", 1))
        resized = saved is not None and saved != dp
        missing = missing_engine_files(directory, record)
        if missing:
            fix = (
                f"resuming {saved} saved ranks on {world} reads every saved rank's shard. "
                if resized
                else ""
            )
            raise FileNotFoundError(
                f"resume_from_checkpoint: {directory} lacks {', '.join(missing)}, which its "
                f"{name} engine wrote (a partial copy?); {fix}Resume from a complete checkpoint"
            )
        if resized:
            logger.info(
                "resume_from_checkpoint: %s was saved on %d %s data-parallel ranks and resumes "
                "on %d: its strategy loads it as a universal checkpoint (converted once, kept "
                "beside it)",
                path,
                saved,
                name,
                dp,
            )
            keep_global_batch(name, role, record, world)
            problems = train_batch_problems(cfg, name, placement(name, role))
            if problems:  # the rescaled batch must still cut a step's samples evenly
                raise ValueError(f"resume_from_checkpoint: {'; '.join(problems)}")
    return path
