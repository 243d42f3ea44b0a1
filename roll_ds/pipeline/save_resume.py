"""Checkpoints of a run and resuming from one.

A checkpoint holds each trained role's engine state (``<role>/``, DeepSpeed tag ``engine``),
the episodes played ahead (``async_generation``), what ``python -m roll_ds.export`` needs
besides the engine state, and the driver's state: step, prompt sampler, RNG. The directory
layout, rotation and ``best`` are ``roll_ds.checkpoint``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from roll_ds.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from roll_ds.config.schema import RLVRConfig
from roll_ds.data.sampler import PromptSampler
from roll_ds.export import ExportInfo
from roll_ds.pipeline.rollout_queue import RolloutQueue
from roll_ds.tracking import ROLLOUTS_FILE, truncate_jsonl_after

logger = logging.getLogger(__name__)


def save_run_checkpoint(
    step: int,
    *,
    cfg: RLVRConfig,
    checkpoints: CheckpointManager,
    clusters: Mapping[str, Any],
    roles: Sequence[str],
    sampler: PromptSampler | None,
    queue: RolloutQueue | None,
    model_dir: str,
) -> Path:
    """Save checkpoint ``step`` of the trained ``roles``; returns its committed directory."""
    partial = checkpoints.begin(step)
    saves = [clusters[n].submit("save_checkpoint", str(partial / n), "engine") for n in roles]
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
    clusters: Mapping[str, Any],
    roles: Sequence[str],
    sampler: PromptSampler | None,
    queue: RolloutQueue | None,
    out_dir: Path,
) -> int:
    """Load checkpoint ``which`` (``resume_from_checkpoint``: a path or ``latest``) into the
    trained ``roles``, the sampler, the queue and the RNG; returns its step."""
    path = checkpoints.resolve(which)
    state = checkpoints.load_state(path)
    for name in roles:
        if not (path / name).is_dir():
            raise FileNotFoundError(
                f"resume_from_checkpoint: {path} has no {name}/ state (saved by a run "
                f"without the {name} role?)"
            )
    loads = [clusters[n].submit("load_checkpoint", str(path / n), "engine") for n in roles]
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
