"""Checkpoints of a run and resuming from one.

A checkpoint holds each trained role's engine state (``<role>/``, DeepSpeed tag ``engine``),
the episodes played ahead (``async_generation``), what ``python -m roll_ds.export`` needs
besides the engine state, and the driver's state: step, prompt sampler, RNG. The directory
layout, rotation and ``best`` are ``roll_ds.checkpoint``'s.

``check_resume`` reads the checkpoint before any actor starts: the trained roles' directories and
the files their engine records (``engine.json``) list must be there, so a partial copy fails
naming what it lacks instead of inside a worker. A role resumed on another data-parallel size
than it was saved on is loaded by its strategy from a universal checkpoint, which
``check_resume`` has converted here, in the driver, before any actor starts (the strategy's
``resized_resume`` hook; DeepSpeed: ``strategies/deepspeed/universal.py``), bounded by its size
(``fault_tolerance.convert_min_mib_per_s``) and kept for later resumes and restarts; that needs
every saved rank's shard, and keeps the role's global batch (``resume_batch``:
``gradient_accumulation_steps`` rescaled, or a clear error).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from zipfile import is_zipfile

from roll_ds.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    missing_engine_files,
    read_engine_record,
    read_json,
    restore_rng_state,
)
from roll_ds.config.checks.pipeline import train_batch_problems
from roll_ds.config.role_placement import placement
from roll_ds.config.schema import RLVRConfig
from roll_ds.config.strategies import STRATEGY_SPECS, load_hook
from roll_ds.data.sampler import PromptSampler
from roll_ds.distributed.errors import WorkerError
from roll_ds.distributed.recovery import is_dead
from roll_ds.export import EXPORT_INFO, ExportInfo
from roll_ds.pipeline.model_roles import TrainingRole
from roll_ds.pipeline.resume_batch import keep_global_batch
from roll_ds.pipeline.rollout_queue import RolloutQueue
from roll_ds.tracking import ROLLOUTS_FILE, truncate_jsonl_after

logger = logging.getLogger(__name__)

ENGINE_TAG = "engine"  # each trained role's engine state: <checkpoint>/<role>/engine/
# Start-up of a conversion's process (interpreter, DeepSpeed's import) and its listing: seconds
# measured; the rest of its bound scales with the checkpoint's bytes (conversion_bound_s).
CONVERT_BASE_S = 300.0


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
    for name, call in zip(roles, loads, strict=True):
        try:
            call.get()
        except WorkerError as exc:
            if is_dead(exc):  # a rank that died while loading: restartable
                raise
            # the load raised: the files (or their fit to this config) are wrong; another
            # attempt reads the same ones (restarts.py stops on a CheckpointError)
            raise CheckpointError(
                f"resume_from_checkpoint: loading {path / name} into {name} failed on rank "
                f"{exc.rank}: {str(exc).splitlines()[0]}. The checkpoint is damaged or does not "
                "fit this config; an automatic restart would load the same files, so the run "
                "stops: resume from another checkpoint (resume_from_checkpoint=<its path>) or "
                "with the settings it was saved under"
            ) from exc
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
    is changed in place), and what its strategy loads on the new size prepared (converted)
    once every role passed. Returns the checkpoint's path."""
    assert cfg.resume_from_checkpoint, "only a resuming run is checked"
    path = checkpoints.resolve(cfg.resume_from_checkpoint)
    checkpoints.load_state(path)  # pipeline_state.json there, and JSON
    for record_file in sorted(path.rglob("*.json")):  # every JSON file of it parses
        read_json(record_file)
    if "actor_train" in roles:
        check_lora_shape(cfg, path)
    to_prepare: list[str] = []  # the roles resumed on another size
    for name in roles:
        directory = path / name / ENGINE_TAG
        if not directory.is_dir():
            raise FileNotFoundError(
                f"resume_from_checkpoint: {path} has no {name}/{ENGINE_TAG}/ state (saved by a "
                f"run without the {name} role?)"
            )
        record = read_engine_record(directory)
        if record is None:  # an older checkpoint: its strategy checks what it loads
            damaged = truncated_files(directory, sorted(p.name for p in directory.glob("*.pt")))
            if damaged:
                raise CheckpointError(
                    f"resume_from_checkpoint: {directory / damaged[0]} is damaged: not a "
                    f"complete torch file (truncated?){_and_more(damaged)}; resume from "
                    "another checkpoint"
                )
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
        damaged = truncated_files(directory, record.get("files", []))
        if damaged:
            raise CheckpointError(
                f"resume_from_checkpoint: {directory / damaged[0]} is damaged: not a complete "
                f"torch file (truncated?){_and_more(damaged)}; resume from another checkpoint"
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
            to_prepare.append(name)
    for name in to_prepare:  # after every cheap check: a bad config fails before a long conversion
        prepare_resized(cfg, name, path / name)
    return path


def truncated_files(directory: Path, names: Sequence[str]) -> list[str]:
    """The ``.pt`` files among ``names`` that are not whole: torch saves a zip archive, whose
    directory is at its end, so a cut file lacks it (read from the end: cheap at any size)."""
    return [
        n
        for n in names
        if n.endswith(".pt") and (directory / n).is_file() and not is_zipfile(directory / n)
    ]


def _and_more(names: Sequence[str]) -> str:
    return f" (and {len(names) - 1} more: {', '.join(names[1:4])})" if len(names) > 1 else ""


def check_lora_shape(cfg: RLVRConfig, path: Path) -> None:
    """The policy's LoRA adapter as the checkpoint's ``export_info.json`` records it (absent:
    an older checkpoint, unchecked) against ``actor_train.model_args``: another rank or target
    is another shape, which DeepSpeed's load would refuse after every role started."""
    info_file = path / EXPORT_INFO
    if not info_file.is_file():
        return
    saved = read_json(info_file).get("lora")
    args = cfg.actor_train.model_args
    field = "actor_train.model_args"
    if saved is None and args.lora_rank is not None:
        raise ValueError(
            f"resume_from_checkpoint: {info_file} records a policy trained without LoRA, but "
            f"{field}.lora_rank is {args.lora_rank}; set {field}.lora_rank=null to resume it"
        )
    if saved is None:
        return
    if args.lora_rank is None:
        raise ValueError(
            f"resume_from_checkpoint: {info_file} records a LoRA adapter of rank "
            f"{saved['rank']}, but {field}.lora_rank is null; set {field}.lora_rank="
            f"{saved['rank']} (and lora_target={saved['target']}) to resume it"
        )
    for key, value in (("rank", args.lora_rank), ("target", args.lora_target)):
        if _lora_value(key, saved.get(key)) != _lora_value(key, value):
            raise ValueError(
                f"resume_from_checkpoint: {info_file} records the LoRA adapter's {key} as "
                f"{saved.get(key)!r}, but {field}.lora_{key} is {value!r}: another adapter "
                f"shape; set {field}.lora_{key}={saved.get(key)} to resume it"
            )


def _lora_value(key: str, value: object) -> object:
    """A LoRA setting as it shapes the adapter: a target list's order and spaces do not."""
    if key == "target" and isinstance(value, str) and value != "all-linear":
        return frozenset(t.strip() for t in value.split(","))
    return value


def conversion_bound_s(source: Path, mib_per_s: float) -> float:
    """How long preparing ``source`` for another size may take: ``CONVERT_BASE_S`` plus its
    bytes at ``mib_per_s`` (DeepSpeed's ``ds_to_universal`` reads every shard once and writes
    the merged states through a temporary copy: about four times the bytes of disk traffic)."""
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    return CONVERT_BASE_S + size / (mib_per_s * 2**20)


def prepare_resized(cfg: RLVRConfig, name: str, directory: Path) -> None:
    """Role ``name``'s checkpoint (``directory``, tag ``ENGINE_TAG``) prepared by its strategy
    for a load on another data-parallel size, here in the driver (no rank waits for it),
    bounded by ``fault_tolerance.convert_min_mib_per_s``."""
    spec = STRATEGY_SPECS.get(getattr(cfg, name).strategy_args.strategy_name)
    if spec is None or spec.resized_resume is None:
        return
    rate = cfg.fault_tolerance.convert_min_mib_per_s
    bound = conversion_bound_s(directory / ENGINE_TAG, rate)
    try:
        load_hook(spec.resized_resume)(str(directory), ENGINE_TAG, timeout_s=bound)
    except TimeoutError as exc:
        raise CheckpointError(
            f"resume_from_checkpoint: {exc} (the bound for its size at "
            f"fault_tolerance.convert_min_mib_per_s={rate:g}); on a slower disk lower "
            "fault_tolerance.convert_min_mib_per_s, or resume on the data-parallel size it was "
            "saved on"
        ) from None
