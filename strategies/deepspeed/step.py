"""The pieces of one ``train_step``: the batch's split into micro batches, the mini-batch
normalizers of a loss that normalizes over the whole optimizer step, and the metrics tally."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from roll_ds.algorithms.aggregation import MiniBatchNorm
from strategies import _common

LossFn = Callable[..., tuple[torch.Tensor, Mapping[str, float]]]
"""``loss_fn(logprobs_BT, micro_batch, entropy_BT[, norm=...]) -> (loss, metrics)``
(``values_BT`` in place of ``logprobs_BT`` for ``head="value"``); ``entropy_BT`` is None unless
``train_step(with_entropy=True)``. DeepSpeed divides each micro batch's loss by
``gradient_accumulation_steps`` and averages gradients over data-parallel ranks. A loss that
normalizes over the whole optimizer-step mini-batch (``roll_ds.pipeline.loss_fns``) has a
``mini_batch_counts(micro_batch)`` method; it then gets ``norm=MiniBatchNorm(...)`` with the
mini-batch's counts (all-reduced over the ranks) and the factor that undoes that averaging. A
plain callable is called without ``norm`` (each micro batch normalized on its own)."""


def split_micro_batches(
    batch: Mapping[str, torch.Tensor], *, micro: int, accum: int
) -> list[dict[str, Any]]:
    """``batch`` as micro batches of ``micro`` rows; its size must be a multiple of
    ``micro * accum`` (whole optimizer steps)."""
    size = _common.batch_size_of(batch)
    if size % (micro * accum):
        raise ValueError(
            f"train_step: batch of {size} rows is not a multiple of "
            f"per_device_train_batch_size x gradient_accumulation_steps = {micro} x {accum}"
        )
    return _common.split_batch(batch, micro)


def mini_batch_norms(
    chunks: list[dict[str, Any]],
    loss_fn: LossFn,
    *,
    accum: int,
    world_size: int,
    device: torch.device,
) -> list[MiniBatchNorm] | None:
    """One ``MiniBatchNorm`` per optimizer step of ``chunks`` (``accum`` consecutive micro
    batches each): the counts of the whole mini-batch, summed over this rank's micro batches and
    all-reduced over the data-parallel ranks (one collective per train step). None for a loss
    without ``mini_batch_counts``."""
    counts_of = getattr(loss_fn, "mini_batch_counts", None)
    if counts_of is None:
        return None
    per_step = torch.stack(
        [
            torch.stack([counts_of(mb) for mb in chunks[k : k + accum]]).sum(0)
            for k in range(0, len(chunks), accum)
        ]
    ).to(torch.float64)
    if dist.is_initialized() and world_size > 1:
        per_step = per_step.to(device)
        dist.all_reduce(per_step)
    scale = float(accum * world_size)
    return [
        MiniBatchNorm(tokens=tokens, sequences=sequences, scale=scale)
        for tokens, sequences in per_step.cpu().tolist()
    ]


def grad_norm(module: torch.nn.Module) -> float | None:
    """2-norm of the full gradients held by ``module`` (ZeRO-0), None when there are none."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.sqrt(sum(g.detach().double().pow(2).sum() for g in grads)))


@dataclass
class StepTally:
    """What a ``train_step`` reports: per-micro-batch metrics averaged, the optimizer steps
    taken, the LR of the last one and the mean gradient norm of those that report one."""

    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)

    def add_micro_batch(self, loss: torch.Tensor, metrics: Mapping[str, Any]) -> None:
        for k, v in {"loss": loss.detach().float().item(), **metrics}.items():
            value = v.detach().float().item() if isinstance(v, torch.Tensor) else float(v)
            self.sums[k] = self.sums.get(k, 0.0) + value

    def add_optimizer_step(self, norm: float | None) -> None:
        self.steps += 1
        if norm is not None:
            self.grad_norms.append(float(norm))

    def result(self, micro_batches: int) -> dict[str, float]:
        result = {k: v / micro_batches for k, v in self.sums.items()}
        result["optimizer_steps"] = float(self.steps)
        result["lr"] = self.lrs[-1]
        if self.grad_norms:
            result["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return result
