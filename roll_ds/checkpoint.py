"""Atomic pipeline checkpoints.

Layout under ``<output_dir>/checkpoints``::

    step_000020/            a complete checkpoint (renamed into place once every part is in)
        pipeline_state.json driver state: step, data position, RNG states
        actor_train/        engine state written by the training workers (DeepSpeed layout)
        COMPLETE            marker, written last before the rename
    latest                  name of the newest complete checkpoint, replaced atomically

A save writes into ``step_000020.partial`` and renames it when done, so a crash mid-save leaves
the previous checkpoint and ``latest`` untouched; leftover ``.partial`` directories are removed
on the next save. Training workers on several nodes must see the same filesystem.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
LATEST = "latest"
STATE_FILE = "pipeline_state.json"
PARTIAL = ".partial"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int | None = None) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def begin(self, step: int) -> Path:
        """Create and return the partial directory the parts of checkpoint ``step`` go into."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"*{PARTIAL}"):
            shutil.rmtree(stale, ignore_errors=True)
        partial = self.root / f"{step_name(step)}{PARTIAL}"
        partial.mkdir()
        return partial

    def commit(self, partial: Path, state: dict[str, Any]) -> Path:
        """Write the driver state, mark complete, rename into place, then point ``latest`` at it."""
        _write_atomic(partial / STATE_FILE, json.dumps(state, indent=1, sort_keys=True))
        _write_atomic(partial / COMPLETE, "")
        final = partial.with_name(partial.name.removesuffix(PARTIAL))
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(self.root)
        _write_atomic(self.root / LATEST, final.name)
        self._prune()
        return final

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / COMPLETE).is_file() else None

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

    def _prune(self) -> None:
        if not self.keep_last:
            return
        done = sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).is_file())
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch CPU RNG states in a JSON-serialisable form."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
