"""Resuming on another data-parallel size: a DeepSpeed universal checkpoint.

A ZeRO checkpoint holds each rank's partition of the optimizer state (fp32 master weights, Adam
moments), cut for the data-parallel size that saved it; DeepSpeed refuses to load it into an
engine of another size. ``deepspeed.checkpoint.ds_to_universal`` merges the partitions into one
file per parameter and state (``<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``),
which an engine of any size loads with ``checkpoint.load_universal``.

The conversion runs once, in the driver before any trainer starts (``prepare_resized``, the
``resized_resume`` hook of the strategy's spec, called by ``roll_ds.pipeline.save_resume``), in a
child process of its own: no rank waits in a collective while it runs (it reads every rank's
optimizer file, minutes for a 7B model, where a barrier's 10-minute process-group timeout killed
the waiting ranks), and no trainer actor holds the optimizer files it loads. It is bounded by the
driver's ``conversion_bound_s`` (300 s plus the checkpoint's bytes at
``fault_tolerance.convert_min_mib_per_s``); past it the child's process group is killed. It
writes into ``<tag>_universal.tmp`` and renames that to ``<tag>_universal``, so a crash or a
timeout leaves no half-converted directory a later resume would trust (the partial one is
removed); a restart, or a second resume on the new size, finds it and converts nothing. The
trainers' load (``converted_tag``) only reads it.

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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from roll_ds.checkpoint import CheckpointError

logger = logging.getLogger(__name__)

SUFFIX = "_universal"
PARTIAL = ".tmp"


def universal_tag(tag: str) -> str:
    return f"{tag}{SUFFIX}"


def converted_tag(path: str, tag: str) -> str:
    """The tag of ``path/tag``'s universal checkpoint, which the driver converted before the
    trainers started (``prepare_resized``); a rank never converts (nor waits for it)."""
    target = os.path.join(path, universal_tag(tag))
    if not os.path.isdir(target):
        source = os.path.join(path, tag)
        raise FileNotFoundError(
            f"{target} is missing: a checkpoint resumed on another data-parallel size is "
            "converted to a universal checkpoint by the driver before the trainers start "
            "(roll_ds.pipeline.save_resume.check_resume), which every node of the role must "
            "see (a shared filesystem); outside the pipeline convert it first: "
            f"python -m strategies.deepspeed.universal {source} {target}"
        )
    return universal_tag(tag)


def prepare_resized(path: str, tag: str, *, timeout_s: float) -> str:
    """Driver side, before any trainer starts: ``path/tag`` converted to a universal checkpoint
    beside it, unless an earlier resume (or restart) did; returns its directory. Raises
    ``TimeoutError`` past ``timeout_s`` and ``CheckpointError`` when the conversion fails; either
    leaves no partial output."""
    target = os.path.join(path, universal_tag(tag))
    if os.path.isdir(target):
        logger.info("%s: converted by an earlier resume, kept", target)
        return target
    convert_in_child(os.path.join(path, tag), target, timeout_s=timeout_s)
    return target


def convert_in_child(source: str, target: str, *, timeout_s: float) -> None:
    """``convert`` in a process of its own (``python -m strategies.deepspeed.universal``),
    killed with its children past ``timeout_s``."""
    root = str(Path(__file__).resolve().parents[2])  # where ``strategies`` imports from
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", __name__, source, target]
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as output:
        child = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = child.wait(timeout=timeout_s)
        except BaseException as exc:  # the bound, or a Ctrl-C: no conversion left behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            shutil.rmtree(f"{target}{PARTIAL}", ignore_errors=True)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise TimeoutError(
                    f"converting {source} to a universal checkpoint did not end within "
                    f"{timeout_s:.0f} s; the partial {target}{PARTIAL} was removed"
                ) from None
            raise
        output.seek(0)
        log = output.read()
    if code != 0:
        shutil.rmtree(f"{target}{PARTIAL}", ignore_errors=True)
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise CheckpointError(
            f"converting {source} to a universal checkpoint failed (exit {code}; a damaged or "
            f"incomplete checkpoint?):\n{tail}"
        )
    logger.info(
        "converted %s to a universal checkpoint %s in %.1f s (a process of its own, before the "
        "trainers start)",
        source,
        target,
        time.perf_counter() - started,
    )


def convert(source: str, target: str) -> None:
    """``ds_to_universal`` of ``source`` into ``target``, atomically."""
    from deepspeed.checkpoint import ds_to_universal

    partial = f"{target}{PARTIAL}"
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


def main(argv: list[str] | None = None) -> None:
    """``python -m strategies.deepspeed.universal SOURCE TARGET``: convert a DeepSpeed
    checkpoint tag directory into a universal checkpoint (what ``prepare_resized`` runs)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("source", help="a checkpoint's tag directory, e.g. .../actor_train/engine")
    parser.add_argument("target", nargs="?", help="default: SOURCE with the _universal suffix")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
    source = args.source.rstrip(os.sep)
    target = args.target or f"{source}{SUFFIX}"
    if os.path.isdir(target):
        logger.info("%s exists: nothing to convert", target)
        return
    convert(source, target)


if __name__ == "__main__":
    main()
