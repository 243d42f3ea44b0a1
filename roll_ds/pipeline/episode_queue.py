"""Agentic episodes played ahead of the train step that uses them (``async_generation`` for
the agentic pipeline).

With ``max_staleness = k`` the episodes of step ``t + k`` start at the start of step ``t``, in a
driver thread of their own, while the trainer trains step ``t`` on episodes played earlier.
Every turn is one generate call on the rollout engines, so a weight sync lands between two turns
of the episodes in flight (``mode: batch``) or between two decode steps of a turn (``mode:
stream``): an episode started with the weights of version ``v`` may finish with newer ones.
``rollout/staleness`` reports the bound, ``step - v`` (at most ``k``); the trainer recomputes
the old log-probs and truncated importance sampling corrects for the rest, as for RLVR.

Episode ids of step ``s`` start at ``s x episodes per step``, so the environments of the steps
in flight never share an id on the environment workers.

Checkpoints: the episodes in flight are played to the end and stored with the checkpoint
(``episodes_in_flight.json``: every token, log-prob, reward and readable turn; JSON floats
round-trip exactly). A resumed run trains on exactly those episodes.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from roll_ds.agentic.episode import Episode
from roll_ds.pipeline.rollout_queue import RolloutQueue

STATE_FILE = "episodes_in_flight.json"


@dataclass
class EpisodesInFlight:
    """One step's episodes: the policy version that started them and, until they are
    collected, the future of the driver thread playing them."""

    step: int
    version: int
    future: Future | None = None
    output: dict[str, Any] | None = field(default=None, repr=False)  # episodes, timings

    def collect(self, timeout_s: float | None = None) -> dict[str, Any]:
        if self.output is None:
            episodes, timings = self.future.result(timeout_s)
            self.output = {"episodes": episodes, "timings": timings}
            self.future = None
        return self.output

    def staleness(self, step: int) -> tuple[float, float]:
        bound = float(step - self.version)
        return bound, bound


class EpisodeQueue(RolloutQueue):
    """``RolloutQueue``'s order and bounds (``fill``, ``take``, ``wait_next``) over
    ``EpisodesInFlight``; checkpoints store episodes instead of generation columns."""

    def wait_for_sync(self, timeout_s: float | None = None) -> None:
        """The next step's episodes (its staleness bound); turns of later steps are one
        generate call each and wait at the sync gate (``sync_gate.py``) instead."""
        self.wait_next(timeout_s)

    def save(self, directory: Path, timeout_s: float | None = None) -> None:
        self.wait_all(timeout_s)
        state = [
            {
                "step": item.step,
                "version": item.version,
                "timings": item.output["timings"],
                "episodes": [asdict(e) for e in item.output["episodes"]],
            }
            for item in self.items
        ]
        (directory / STATE_FILE).write_text(json.dumps(state))

    def load(self, directory: Path) -> None:
        self.items.clear()
        path = directory / STATE_FILE
        if not path.is_file():
            return
        for saved in json.loads(path.read_text()):
            output = {
                "episodes": [Episode(**e) for e in saved["episodes"]],
                "timings": saved["timings"],
            }
            self.items.append(EpisodesInFlight(saved["step"], saved["version"], output=output))
