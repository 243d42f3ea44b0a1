"""Resuming on another data-parallel size: a DeepSpeed universal checkpoint.

A ZeRO checkpoint holds each rank's partition of the optimizer state (fp32 master weights, Adam
moments), cut for the data-parallel size that saved it; DeepSpeed refuses to load it into an
engine of another size. ``deepspeed.checkpoint.ds_to_universal`` merges the partitions into one
file per parameter and state (``<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``),
which an engine of any size loads with ``checkpoint.load_universal``.

The conversion runs once, on rank 0, into ``<tag>_universal`` beside the checkpoint: written to
``<tag>_universal.tmp`` and renamed, so a crash leaves no half-converted directory that a later
resume would trust; a second resume on the new size finds it and converts nothing.

ZeRO-3 is refused (``ZERO3_REFUSAL``): with DeepSpeed 0.19.8 the conversion and the load run, and
the resumed step's loss equals the saving size's (the weights arrive), but the step it takes
moves the biases and norms (the engine's second parameter group) 14% less than the
uninterrupted run does (8.6e-4 against 1.0e-3 at lr 1e-3; the matrices agree to 4e-9:
tests/integration/test_universal_checkpoint.py, 2 ranks -> 1, full fine-tuning), so part of the
optimizer state does not survive the trip. A LoRA ZeRO-3 preset whose adapter trains at stage 1 or 2
(``zero3_adapter_stage``, the default with a whole frozen base) is a stage-1/2 engine here.
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
ZERO3_REFUSAL = (
    "a ZeRO-3 checkpoint does not resume on another data-parallel size (DeepSpeed's universal "
    "checkpoint loses part of its optimizer state: strategies/deepspeed/universal.py). Resume "
    "it on the ranks it was saved on (the role's device_mapping / world_size), or train under "
    "a ZeRO-2 preset (strategy_config), or with LoRA zero3_adapter_stage: 1 or 2, when the "
    "size may change"
)


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
