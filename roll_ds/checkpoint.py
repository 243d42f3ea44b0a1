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

RNG states are stored as JSON, never pickled: loading a checkpoint someone else wrote cannot run
code.
"""

from __future__ import annotations

import json
import logging
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
        return json.loads((path / STATE_FILE).read_text())

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
