"""Crash-safe pipeline checkpoints.

Layout under ``<output_dir>/checkpoints``::

    step_000020/            a complete checkpoint
        pipeline_state.json driver state: step, data position, RNG states
        actor_train/        engine state written by the training workers (DeepSpeed layout) and
                            each rank's RNG states (``rng_state_rank<r>.json``)
        COMPLETE            marker, written last before the rename
    latest                  name of the newest complete checkpoint, replaced atomically

A save goes through these steps; a process killed between any two of them (or a machine that
loses power: every file and directory is fsynced before the rename that publishes it) leaves a
complete checkpoint for ``latest()`` to find:

1. the parts go into ``step_000020.partial``; ``commit`` fsyncs every file and directory in it,
   then writes ``pipeline_state.json`` and ``COMPLETE``;
2. an existing ``step_000020`` (a step saved again after resuming from an earlier one) is renamed
   aside to ``step_000020.old``, not deleted;
3. the partial directory is renamed to ``step_000020``;
4. ``latest`` is replaced (temporary file, fsync, rename, fsync of the directory);
5. the aside copy and the checkpoints beyond ``keep_last`` are deleted (each renamed to
   ``*.old`` first, so a half-deleted directory never looks complete).

``latest()`` follows the pointer when it names a complete checkpoint, else (a crash in steps 2-4
leaves it missing or dangling) it falls back to the newest complete ``step_NNNNNN`` directory.
Leftover ``.partial`` and ``.old`` directories are deleted by the next save. Training workers
on several nodes must see the same filesystem.

With ``save_best`` (``BestCheckpoint``) the checkpoint with the best value of an eval metric is
kept beside them, out of ``keep_last``'s reach::

    best -> best_step_000020_<id>   a symlink, replaced atomically, to a complete checkpoint
    best_step_000020_<id>/          hard links to step_000020's files (a copy where the
                                    filesystem has none), plus best.json: metric, mode, value, step

so ``checkpoints/best`` resumes, exports and evaluates like any step directory.

RNG states are stored as JSON, never pickled: loading a checkpoint someone else wrote cannot run
code.

A trained role's engine directory (``actor_train/engine/``) holds ``engine.json``, the record a
train strategy writes beside its files (``ENGINE_RECORD``): ``world_size`` and ``dp_world_size``
of the engine that saved it, the rows of its optimizer steps (``train_batch_size``, all ranks
together) and the ``files`` its ranks wrote, so the driver tells a partial checkpoint, and a
resume on another data-parallel size or batch, before any actor starts. A backend adds its own
keys (DeepSpeed: ``zero_stage``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
LATEST = "latest"
STATE_FILE = "pipeline_state.json"
PARTIAL = ".partial"
OLD = ".old"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; ``keep_last`` complete ones are kept (0 or
    None: all)."""

    def __init__(self, root: str | Path, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last={keep_last}: must be >= 0 (0 keeps every checkpoint)")
        self.root = Path(root)
        self.keep_last = keep_last

    def begin(self, step: int) -> Path:
        """Create and return the partial directory the parts of checkpoint ``step`` go into,
        after deleting what an interrupted save left behind."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in [*self.root.glob(f"*{PARTIAL}"), *self.root.glob(f"*{OLD}")]:
            shutil.rmtree(stale, ignore_errors=True)
        partial = self.root / f"{step_name(step)}{PARTIAL}"
        partial.mkdir()
        return partial

    def commit(self, partial: Path, state: dict[str, Any]) -> Path:
        """Make ``partial`` durable and complete, rename it into place, point ``latest`` at it,
        then delete what is no longer needed (see the module docstring for the steps)."""
        _fsync_tree(partial)  # the workers' files (DeepSpeed does not fsync what it saves)
        _write_atomic(partial / STATE_FILE, json.dumps(state, indent=1, sort_keys=True))
        _write_atomic(partial / COMPLETE, "")
        final = partial.with_name(partial.name.removesuffix(PARTIAL))
        aside = final.with_name(final.name + OLD)
        if final.exists():  # re-saving a step: keep the old copy until the new one is in place
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
            _fsync_dir(self.root)
        os.rename(partial, final)
        _fsync_dir(self.root)
        _write_atomic(self.root / LATEST, final.name)
        if aside.exists():
            shutil.rmtree(aside)
        self._prune(keep=final)
        return final

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names if it is complete, else the newest complete one."""
        pointer = self.root / LATEST
        if pointer.is_file():
            path = self.root / pointer.read_text().strip()
            if (path / COMPLETE).is_file():
                return path
        done = self.complete_steps()
        if done:
            logger.warning(
                "%s is missing or names no complete checkpoint (a save was interrupted); "
                "using the newest complete one, %s",
                pointer,
                done[-1].name,
            )
            return done[-1]
        return None

    def complete_steps(self) -> list[Path]:
        """Complete ``step_NNNNNN`` directories, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.fullmatch(path.name)
            if match and (path / COMPLETE).is_file():
                found.append((int(match.group(1)), path))
        return [path for _, path in sorted(found)]

    def resolve(self, resume_from: str) -> Path:
        """``"latest"`` or a checkpoint directory -> a complete checkpoint directory."""
        path = self.latest() if resume_from == LATEST else Path(resume_from)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint: no complete checkpoint under {self.root}; "
                "start without resume_from_checkpoint"
            )
        if not (path / COMPLETE).is_file():
            raise FileNotFoundError(
                f"resume_from_checkpoint: {path} is not a complete checkpoint "
                f"(no {COMPLETE} marker); use 'latest' or a step_NNNNNN directory"
            )
        return path

    @staticmethod
    def load_state(path: Path) -> dict[str, Any]:
        """The driver's state ``path/pipeline_state.json``; missing or not JSON: a
        ``CheckpointError`` naming the file."""
        state = path / STATE_FILE
        if not state.is_file():
            raise CheckpointError(
                f"resume_from_checkpoint: {state} is missing (the driver's step, data position "
                "and RNG states; a partial copy?); resume from a complete checkpoint"
            )
        return read_json(state)

    def _prune(self, keep: Path) -> None:
        """Delete all but the newest ``keep_last`` complete checkpoints, never ``keep`` (the one
        just saved: after resuming from an earlier step, newer directories of the abandoned run
        may still sort after it)."""
        if not self.keep_last:
            return
        for old in self.complete_steps()[: -self.keep_last]:
            if old != keep:
                trash = old.with_name(old.name + OLD)
                os.rename(old, trash)
                shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the best checkpoint by an eval metric

BEST = "best"
BEST_RECORD = "best.json"


def is_better(value: float, best: float | None, mode: str) -> bool:
    """Whether ``value`` beats ``best`` (None: nothing yet) under ``mode`` (max or min); a tie
    keeps the earlier checkpoint and NaN never wins."""
    if mode not in ("max", "min"):
        raise ValueError(f"save_best_mode: must be max or min, got {mode!r}")
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


class BestCheckpoint:
    """Keeps the checkpoint with the best ``metric`` under ``root`` as ``root/best`` (layout in
    the module docstring). A resumed run (``resume``) continues from the value ``best.json``
    records; a fresh run starts over, so its own first evaluated checkpoint becomes the best."""

    def __init__(self, root: str | Path, metric: str, mode: str = "max", *, resume: bool) -> None:
        is_better(0.0, None, mode)  # rejects a bad mode now
        self.root = Path(root)
        self.metric = metric
        self.mode = mode
        self._warned = False
        record = self.record() if resume else None
        if record is not None and (record["metric"], record["mode"]) != (metric, mode):
            logger.warning(
                "save_best: %s was kept by %s (%s), now %s (%s) is asked for; the next "
                "evaluated checkpoint replaces it",
                self.root / BEST,
                record["metric"],
                record["mode"],
                metric,
                mode,
            )
            record = None
        self.value: float | None = None if record is None else float(record["value"])

    def record(self) -> dict[str, Any] | None:
        """What ``best/best.json`` says (metric, mode, value, step, checkpoint), or None."""
        path = self.root / BEST / BEST_RECORD
        return json.loads(path.read_text()) if path.is_file() else None

    def offer(self, checkpoint: Path, step: int, metrics: dict[str, float]) -> bool:
        """Make the complete ``checkpoint`` of ``step`` the best one if ``metrics[metric]``
        beats the kept value; returns whether it did. A checkpoint without the metric (no
        eval at its step, a domain absent from the eval data) is skipped with one warning."""
        if self.metric not in metrics:
            if not self._warned:
                logger.warning(
                    "save_best: no %s in the metrics of step %d (evaluated: %s); this "
                    "checkpoint is not considered",
                    self.metric,
                    step,
                    sorted(k for k in metrics if k.startswith("eval/")) or "nothing",
                )
                self._warned = True
            return False
        value = float(metrics[self.metric])
        if not is_better(value, self.value, self.mode):
            return False
        self._publish(checkpoint, step, value)
        self.value = value
        logger.info(
            "save_best: %s=%.4g at step %d, kept as %s", self.metric, value, step, self.root / BEST
        )
        return True

    def _publish(self, checkpoint: Path, step: int, value: float) -> None:
        """Link ``checkpoint`` into a new ``best_*`` directory, then swing ``best`` to it. A
        crash at any point leaves ``best`` at the old or the new copy, both complete."""
        target = self.root / f"{BEST}_{step_name(step)}_{os.urandom(4).hex()}"
        partial = target.with_name(target.name + PARTIAL)
        shutil.copytree(checkpoint, partial, symlinks=True, copy_function=_link_or_copy)
        record = {
            "metric": self.metric,
            "mode": self.mode,
            "value": value,
            "step": step,
            "checkpoint": checkpoint.name,
        }
        _write_atomic(partial / BEST_RECORD, json.dumps(record, indent=1) + "\n")
        _fsync_tree(partial)
        os.rename(partial, target)
        link = self.root / f"{BEST}.tmp"
        link.unlink(missing_ok=True)
        os.symlink(target.name, link)  # relative: the run directory may move
        os.replace(link, self.root / BEST)
        _fsync_dir(self.root)
        for old in self.root.glob(f"{BEST}_*"):  # earlier bests, and what a crash left
            if old != target and old.is_dir() and not old.name.endswith((PARTIAL, OLD)):
                trash = old.with_name(old.name + OLD)
                os.rename(old, trash)
                shutil.rmtree(trash, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (no bytes copied; the file outlives the pruned step directory), or a copy
    where the filesystem has no hard links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# ---------------------------------------------------------------------------------------------
# what a train strategy records about its engine's files

ENGINE_RECORD = "engine.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded as it is (damaged, incomplete, or its conversion for
    another size failed): loading it again reads the same files, so the automatic restart
    (``roll_ds/pipeline/restarts.py``) stops on it instead of retrying."""


def read_engine_record(directory: str | Path) -> dict[str, Any] | None:
    """``directory/engine.json`` (None: no record, e.g. saved by a roll_ds before it existed)."""
    path = Path(directory) / ENGINE_RECORD
    return read_json(path) if path.is_file() else None


def read_json(path: str | Path) -> Any:
    """A checkpoint's JSON file; one that does not parse is a ``CheckpointError`` naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"resume_from_checkpoint: {path} is not valid JSON ({exc}): the checkpoint is "
            "damaged (a truncated copy?); resume from another checkpoint"
        ) from None


def write_engine_record(directory: str | Path, record: dict[str, Any]) -> None:
    _write_atomic(Path(directory) / ENGINE_RECORD, json.dumps(record, indent=1, sort_keys=True))


def missing_engine_files(directory: str | Path, record: dict[str, Any]) -> list[str]:
    """The files ``record`` lists that ``directory`` lacks."""
    return [name for name in record.get("files", []) if not (Path(directory) / name).is_file()]


# ---------------------------------------------------------------------------------------------
# RNG states as JSON


def capture_rng_state(*, cuda: bool = False) -> dict[str, Any]:
    """Python, NumPy and torch CPU RNG states (with ``cuda``, also the current CUDA device's) in
    a JSON-serialisable form."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
        else:
            logger.warning("checkpoint holds a CUDA RNG state but no CUDA device is visible")


def save_rng_state(path: str | Path, *, cuda: bool = False) -> None:
    """``capture_rng_state`` written durably to ``path`` as JSON."""
    _write_atomic(Path(path), json.dumps(capture_rng_state(cuda=cuda)))


def load_rng_state(path: str | Path) -> bool:
    """Restore what ``save_rng_state`` wrote; False when there is no such file.

    A pickled ``.pt`` file beside it (written by roll_ds before RNG states were JSON) is refused,
    not unpickled: unpickling runs whatever code the file holds.
    """
    path = Path(path)
    if path.is_file():
        restore_rng_state(json.loads(path.read_text()))
        return True
    legacy = path.with_suffix(".pt")
    if legacy.is_file():
        raise ValueError(
            f"{legacy}: RNG states pickled by an older roll_ds; they are not loaded, since "
            "unpickling a file can run any code in it. Delete the file to resume without this "
            "rank's RNG states (the run then no longer equals an uninterrupted one), or start "
            "afresh."
        )
    return False


# ---------------------------------------------------------------------------------------------
# durable writes


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that it holds either its old or its new content after a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
