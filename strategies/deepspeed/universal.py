"""Resuming on another data-parallel size: a DeepSpeed universal checkpoint.

A ZeRO checkpoint holds each rank's partition of the optimizer state (fp32 master weights, Adam
moments), cut for the data-parallel size that saved it; DeepSpeed refuses to load it into an
engine of another size. ``deepspeed.checkpoint.ds_to_universal`` merges the partitions into one
file per parameter and state (``<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``),
which an engine of any size loads with ``checkpoint.load_universal``.

The conversion runs once, on rank 0, into ``<tag>_universal`` beside the checkpoint: written to
``<tag>_universal.tmp`` and renamed, so a crash leaves no half-converted directory that a later
resume would trust; a second resume on the new size finds it and converts nothing.

ZeRO-3 loads through DeepSpeed's stage-3 path
(``load_hp_checkpoint_state_from_checkpoint_dir_stage3``, DeepSpeed 0.19.8), which restores
every parameter and Adam moment exactly (each rank slices its partition of the merged tensors,
padding included) but leaves two things wrong, which ``repair_stage3_load`` puts right after the
load:

- one ``step`` tensor for every sub-group: it reads ``state[0]['step']`` once and assigns that
  same tensor to each sub-group's state; torch's AdamW increments it in place (so would
  DeepSpeedCPUAdam's ``+= 1`` on a tensor step), once per sub-group per optimizer step, so
  the second group (biases and norms) stepped with t = 3 where the run had t = 2: Adam's bias
  correction sqrt(1 - b2^t) / (1 - b1^t) is 0.858 of the right one, the "14% short" step the
  first version measured (and refused ZeRO-3 for). Each sub-group gets its own copy;
- the first group's hyperparameters for every group (``param_groups[0]``), so the
  no-decay group (biases, norms: ``optimizer.param_groups``) would take the matrices'
  ``weight_decay``. Each group gets its own saved values back, as stages 1-2 do.

A LoRA ZeRO-3 preset whose adapter trains at stage 1 or 2 (``zero3_adapter_stage``, the default
with a whole frozen base) is a stage-1/2 engine here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

from strategies.deepspeed.zero import barrier

logger = logging.getLogger(__name__)

SUFFIX = "_universal"


def universal_tag(tag: str) -> str:
    return f"{tag}{SUFFIX}"


def ensure_universal(path: str, tag: str, *, rank: int) -> str:
    """The tag of ``path/tag`` converted to a universal checkpoint, converting it first (rank 0,
    every rank waits) unless an earlier resume did."""
    target = os.path.join(path, universal_tag(tag))
    if rank == 0 and not os.path.isdir(target):
        convert(os.path.join(path, tag), target)
    barrier()
    if not os.path.isdir(target):  # another node's rank 0 wrote it on a filesystem we lack
        raise FileNotFoundError(
            f"{target}: rank 0 converted the checkpoint, but this rank does not see it; every "
            "node of the role must see the checkpoint directory (a shared filesystem)"
        )
    return universal_tag(tag)


def convert(source: str, target: str) -> None:
    """``ds_to_universal`` of ``source`` into ``target``, atomically."""
    from deepspeed.checkpoint import ds_to_universal

    partial = f"{target}.tmp"
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted conversion left
    args = argparse.Namespace(
        input_folder=source,
        output_folder=partial,
        # in-process: the workers are actors whose CPUs are already counted
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # a plain HF model carries no universal_checkpoint_info (only Megatron-style TP models
        # do); DeepSpeed's flag adds the version key it checks for, nothing else
        inject_missing_state=True,
    )
    started = time.perf_counter()
    with _quiet_stdout():
        ds_to_universal.main(args)
    # main() points <parent>/latest_universal at the temporary name; loads name their tag.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(os.path.dirname(partial), "latest_universal"))
    os.rename(partial, target)
    logger.info(
        "converted %s to a universal checkpoint %s in %.1f s",
        source,
        target,
        time.perf_counter() - started,
    )


@contextlib.contextmanager
def universal_loading(engine: Any) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read a universal checkpoint. DeepSpeed reads the setting
    (``checkpoint.load_universal``) only when loading, so it is switched on for this one load
    rather than in the config: the engine is built before the driver's resume decides it."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def repair_stage3_load(engine: Any, path: str, tag: str) -> None:
    """Undo what DeepSpeed's stage-3 universal load leaves wrong (the module docstring): give
    every sub-group its own Adam ``step`` and every parameter group its own saved
    hyperparameters. Call it right after ``engine.load_checkpoint`` of ``path/tag``."""
    import torch

    base = engine.optimizer.optimizer  # the torch (or DeepSpeed CPU) Adam under ZeRO-3's
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved = _saved_param_groups(os.path.join(path, tag, "zero", "optimizer_state.pt"))
    if len(saved) != len(base.param_groups):
        raise ValueError(
            f"{os.path.join(path, tag)} has {len(saved)} optimizer parameter groups and this "
            f"engine {len(base.param_groups)}: resume with the settings it was saved under"
        )
    for group, values in zip(base.param_groups, saved, strict=True):
        group.update({k: v for k, v in values.items() if k != "params"})


def _saved_param_groups(optimizer_state: str) -> list[dict[str, Any]]:
    import torch

    # mmap: the file also holds rank 0's flat fp32 partition and moments, not needed here
    state = torch.load(optimizer_state, map_location="cpu", weights_only=False, mmap=True)
    return list(state["param_groups"])


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """ds_to_universal prints its progress (and tqdm bars) to stdout: into the log instead."""
    import io

    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield
    finally:  # a failed conversion's progress is in the log beside its traceback
        for line in buffer.getvalue().splitlines():
            if line.strip():
                logger.debug("ds_to_universal: %s", line)
