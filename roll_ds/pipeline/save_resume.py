"""Checkpoints of a run and resuming from one.

A checkpoint holds each trained role's engine state (``<role>/``, DeepSpeed tag ``engine``),
the episodes played ahead (``async_generation``), what ``python -m roll_ds.export`` needs
besides the engine state, and the driver's state: step, prompt sampler, RNG. The directory
layout, rotation and ``best`` are ``roll_ds.checkpoint``'s.

``check_resume`` reads the checkpoint before any actor starts: the trained roles' directories and
the files their engine records (``engine.json``) list must be there, so a partial copy fails
naming what it lacks instead of inside a worker. A role resumed on another data-parallel size
than it was saved on is loaded by its strategy from a universal checkpoint, converted once
(DeepSpeed: ``strategies/deepspeed/universal.py``); that needs every saved rank's shard.
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
from roll_ds.config.role_placement import placement
from roll_ds.config.schema import RLVRConfig, WorkerConfig
from roll_ds.data.sampler import PromptSampler
from roll_ds.export import ExportInfo
from roll_ds.pipeline.model_roles import TrainingRole
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
) -> Path:
    """Save checkpoint ``step`` of the trained ``roles``; returns its committed directory."""
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


def check_resume(cfg: RLVRConfig, checkpoints: CheckpointManager, roles: Sequence[str]) -> Path:
    """The checkpoint ``cfg.resume_from_checkpoint`` names, checked before any actor starts:
    every trained role's engine directory with every file its record lists. Returns it."""
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
        world = placement(name, getattr(cfg, name)).world_size
        resized = saved is not None and saved != world
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
        if resized and record.get("not_resizable"):
            raise ValueError(
                f"resume_from_checkpoint: {directory} was saved on {saved} {name} ranks and "
                f"this run has {world}: {record['not_resizable']}"
            )
        saved_rows = record.get("train_batch_size")
        _warn_if_batch_changed(name, getattr(cfg, name), world, saved_rows, directory)
        if resized:
            logger.info(
                "resume_from_checkpoint: %s was saved on %d %s ranks and resumes on %d: its "
                "strategy loads it as a universal checkpoint (converted once, kept beside it)",
                path,
                saved,
                name,
                world,
            )
    return path


def _warn_if_batch_changed(
    name: str, role: WorkerConfig, world: int, saved: int | None, directory: Path
) -> None:
    """Warn, naming the override that keeps it, when an optimizer step of this run would take
    other than the saved run's rows: the usual slip of a resume on another number of ranks
    (each rank's per_device_train_batch_size x gradient_accumulation_steps stays, so 2 ranks ->
    1 halves it and each train step then makes two optimizer steps, consuming the LR schedule
    twice as fast). A warning, not an error: a smaller batch may be the point of the change.
    ``saved``: the checkpoint's rows per optimizer step (None: a record from before them)."""
    args = role.training_args
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    if saved is None or saved == rows:
        return
    per_rank = args.per_device_train_batch_size * world
    keep = (
        f"set {name}.training_args.gradient_accumulation_steps={saved // per_rank} to keep it"
        if saved % per_rank == 0
        else f"choose {name}.training_args.per_device_train_batch_size and "
        f"gradient_accumulation_steps whose product x {world} ranks is {saved} to keep it"
    )
    logger.warning(
        "resume_from_checkpoint: %s took optimizer steps of %d rows (all ranks together); this "
        "run's %s takes %d (%d ranks x per_device_train_batch_size %d x "
        "gradient_accumulation_steps %d), so it does not continue the saved run's optimization: "
        "%s",
        directory,
        saved,
        name,
        rows,
        world,
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        keep,
    )
