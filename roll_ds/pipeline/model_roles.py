"""The model roles the step calls (``reference``, ``actor_train``, ``critic``) as typed handles.

The rollout engines have theirs in ``engines.py``. Each handle wraps the role's ``Cluster`` and
names the worker methods (``roll_ds/pipeline/workers.py``) the step may call, with their
arguments, so a reader of the loop sees what is called and what comes back, and a misspelt
method is an ``AttributeError`` here rather than inside a Ray actor:

    actor = TrainingRole(clusters["actor_train"])
    old = actor.compute_logprobs(inputs, key="old_logprobs")   # Batch, rows as sent
    call = actor.train_step(rows, loss_fn, fill_old_logprobs=True)
    result = call.get()            # TrainResult: each rank's metrics, old_logprobs as sent

A call that returns a pending result (``train_step``, ``compute_values``, the checkpoint calls)
lets the step run roles side by side: the critic computes while the actor does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.workers import TRAIN_METRICS

HANDLED_ROLES = ("actor_train", "critic", "reference")


class ModelRole:
    """A role with a model the step reads log-probs from (the reference, and every trainer)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    @property
    def name(self) -> str:
        return self.cluster.name

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def compute_logprobs(self, inputs: Batch, *, key: str, disable_adapter: bool = False) -> Batch:
        """``inputs``' log-probs ``[B, T-1]`` under the role's model as column ``key``, rows in
        ``inputs``' order; ``disable_adapter``: LoRA's base model (the reference of a LoRA run
        without a reference role)."""
        kwargs = {"disable_adapter": True} if disable_adapter else {}
        return self.cluster.submit("compute_logprobs", inputs, key=key, **kwargs).get()


@dataclass
class TrainResult:
    """One train step of a role: each data-parallel rank's metrics, and (``fill_old_logprobs``)
    the batch's ``old_logprobs`` in the order its rows were sent."""

    rank_metrics: list[dict[str, float]]
    old_logprobs: torch.Tensor | None = None


class PendingTrain:
    """A train step sent to every rank; ``get`` waits for it."""

    def __init__(self, call: Any, fill_old_logprobs: bool) -> None:
        self._call = call
        self._fill_old_logprobs = fill_old_logprobs

    def get(self) -> TrainResult:
        out = self._call.get()
        if not self._fill_old_logprobs:
            return TrainResult(list(out))
        # train_step_with_old_logprobs: the ranks' rows concatenated in rank order (the order
        # sent), each rank's metrics under its own meta key
        metrics = [v for k, v in out.meta.items() if k.startswith(TRAIN_METRICS)]
        return TrainResult(metrics, out["old_logprobs"])


class TrainingRole(ModelRole):
    """A role that trains on the rollout batch (``actor_train``, ``critic``)."""

    def train_step(
        self, rows: Batch, loss_fn: Any, *, fill_old_logprobs: bool = False
    ) -> PendingTrain:
        """One pass's optimizer steps over ``rows`` (dealt to the ranks in order);
        ``fill_old_logprobs``: the step also returns the rows' old log-probs, each taken from
        the forward of its first optimizer step (``logprobs.py``)."""
        method = "train_step_with_old_logprobs" if fill_old_logprobs else "train_step"
        return PendingTrain(self.cluster.submit(method, rows, loss_fn), fill_old_logprobs)

    def compute_values(self, inputs: Batch) -> Any:
        """The critic's values ``[B, T-1]`` of ``inputs`` (pending: ``.get()`` is a Batch)."""
        return self.cluster.submit("compute_values", inputs)

    def save_checkpoint(self, path: str, tag: str) -> Any:
        """Every rank's engine state under ``path/tag`` (pending)."""
        return self.cluster.submit("save_checkpoint", path, tag)

    def load_checkpoint(self, path: str, tag: str) -> Any:
        """Every rank's engine state back from ``path/tag`` (pending)."""
        return self.cluster.submit("load_checkpoint", path, tag)


def role_handles(clusters: Mapping[str, Any]) -> dict[str, ModelRole]:
    """A handle for each model role the run started (a trainer's can train)."""
    return {
        name: (ModelRole if name == "reference" else TrainingRole)(clusters[name])
        for name in HANDLED_ROLES
        if name in clusters
    }
