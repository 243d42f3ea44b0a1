"""A resume on another world size keeps the global batch: the rows of one optimizer step.

A trained role's optimizer step takes ``per_device_train_batch_size x gradient_accumulation_steps
x world size`` rows (``passes.schedule_steps``, ``checks.pipeline.train_batch_problems``). Resumed
on another number of ranks with the same per-rank settings, that product changes: each step
averages over another number of rows, and the run makes another number of optimizer steps per
RL step, so its LR schedule (whose position the checkpoint holds) no longer matches the one it
was saved on. So the global batch is kept: where the config still has the saved per-rank
settings, ``gradient_accumulation_steps`` is rescaled by saved world / new world when that
divides; a config whose settings give the saved global batch already is left alone; anything
else is refused before any actor starts, naming the field and a value that keeps the batch.

Engine records older than this (no ``gradient_accumulation_steps`` in ``engine.json``) are left
to the config as it is.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger(__name__)


def keep_global_batch(name: str, role: Any, record: dict[str, Any], world: int) -> None:
    """Rescale ``role.training_args.gradient_accumulation_steps`` (in place) so that ``role``,
    saved as ``record`` describes and resumed on ``world`` ranks, keeps its global batch; raise
    ValueError naming the field when no whole value does."""
    args = role.training_args
    saved_micro = record.get("per_device_train_batch_size")
    saved_accum = record.get("gradient_accumulation_steps")
    saved_world = record.get("world_size")
    if None in (saved_micro, saved_accum, saved_world):
        return  # an older record: its global batch is unknown
    saved = saved_micro * saved_accum * saved_world
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if micro * accum * world == saved:
        return
    field = f"{name}.training_args"
    kept = (micro, accum) == (saved_micro, saved_accum)
    if kept and saved % (micro * world) == 0:
        _require_auto(name, role)
        args.gradient_accumulation_steps = saved // (micro * world)
        logger.info(
            "resume_from_checkpoint: %s.gradient_accumulation_steps %d -> %d, keeping the "
            "global batch of %d rows (saved on %d ranks, resumed on %d)",
            field,
            accum,
            args.gradient_accumulation_steps,
            saved,
            saved_world,
            world,
        )
        return
    raise ValueError(
        f"resume_from_checkpoint: {name} was saved on {saved_world} ranks with a global batch "
        f"of {saved} rows per optimizer step (per_device_train_batch_size {saved_micro} x "
        f"gradient_accumulation_steps {saved_accum} x {saved_world}); on {world} ranks "
        f"{field} gives {micro} x {accum} x {world} = {micro * accum * world}, and a resumed "
        f"run keeps the global batch (its LR schedule and step count assume it). "
        f"{_fix(field, saved, micro, world)}"
    )


def _require_auto(name: str, role: Any) -> None:
    """The DeepSpeed JSON must take the batch sizes from the training args ("auto", as every
    preset does): a number there would disagree with the rescaled accumulation inside a worker
    (``roll_ds.config.deepspeed.build_deepspeed_config``); said here, before any starts."""
    ds = getattr(role.strategy_args, "strategy_config", None) or {}
    fixed = [
        key
        for key in ("gradient_accumulation_steps", "train_batch_size")
        if key in ds and ds[key] != "auto"
    ]
    if fixed:
        raise ValueError(
            f"resume_from_checkpoint: keeping {name}'s global batch on another world size "
            f"rescales {name}.training_args.gradient_accumulation_steps, but "
            f"{name}.strategy_args.strategy_config sets {', '.join(fixed)}: set them to auto"
        )


def _fix(field: str, saved: int, micro: int, world: int) -> str:
    """What to set: a per-rank split of ``saved`` rows over ``world`` ranks, or other sizes."""
    if saved % world:
        sizes = [n for n in range(1, saved + 1) if saved % n == 0]
        return (
            f"{saved} rows do not split over {world} ranks: resume on a world size dividing "
            f"{saved} ({', '.join(map(str, sizes))})"
        )
    rows = saved // world  # per rank, per optimizer step
    if rows % micro == 0:
        return f"Set {field}.gradient_accumulation_steps: {rows // micro}"
    fits = math.gcd(micro, rows)  # the largest micro batch up to this one that divides
    return (
        f"Set {field}.per_device_train_batch_size: {fits} and gradient_accumulation_steps: "
        f"{rows // fits} (rows per rank and optimizer step: {rows})"
    )
