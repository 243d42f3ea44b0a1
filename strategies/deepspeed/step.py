"""The pieces of one ``train_step``: the batch's split into micro batches (``micro`` rows each,
or by a token budget: ``token_micro_batches``), the mini-batch normalizers of a loss that
normalizes over the whole optimizer step, and the metrics tally.

With a token budget an optimizer step's rows (``micro x accum`` per rank, as without one) are
cut into a number of micro batches that varies from step to step; the ranks agree on it per step
(all-reduce MAX, one collective per train step) and the strategy marks the accumulation boundary
itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from roll_ds.algorithms.aggregation import MiniBatchNorm
from roll_ds.models.value_model import forward_values
from strategies import _common
from strategies.deepspeed.sequence_parallel import SequenceParallel, group_budget
from strategies.micro_batches import (
    PackedRows,
    match_count,
    packed_forward,
    plan_micro_batches,
    row_widths,
    select_rows,
)

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


def micro_batch_plan(
    batch: Mapping[str, torch.Tensor],
    loss_fn: LossFn,
    *,
    micro: int,
    accum: int,
    budget: int | None,
    packed: bool,
    world_size: int,
    device: torch.device,
    sp: SequenceParallel | None = None,
) -> tuple[list[dict[str, Any]], list[int], list[list[int]], list[MiniBatchNorm] | None]:
    """``batch`` as micro batches of ``micro`` rows (``budget`` None) or of about ``budget``
    tokens (``token_micro_batches``); the number of micro batches of each optimizer step of
    ``micro x accum`` rows; each micro batch's rows of ``batch``; and ``loss_fn``'s
    mini-batch normalizers (``mini_batch_norms``).

    ``sp``: the micro batches are the SP group's (``SequenceParallel.gather_rows``), its step k
    its ranks' steps k together, so an optimizer step has ``size`` times the rows; a budget
    counts a rank's share of a micro batch's tokens (``size`` times as many in all). Rows are
    then the group's, not ``batch``'s."""
    replicas = 1
    if sp is not None:
        batch, _ = sp.gather_rows(batch, rows_per_step=micro * accum)
        accum, budget = accum * sp.size, group_budget(sp, budget)
        replicas = sp.size
    if budget is not None:
        chunks, steps, rows = token_micro_batches(
            batch,
            budget=budget,
            micro=micro,
            accum=accum,
            packed=packed,
            world_size=world_size,
            device=device,
        )
    else:
        chunks = split_micro_batches(batch, micro=micro, accum=accum)
        steps = [accum] * (len(chunks) // accum)
        size = _common.batch_size_of(batch)
        rows = [list(range(a, b)) for a, b in _common.iter_chunks(size, micro)]
    kw = {"world_size": world_size, "device": device, "replicas": replicas}
    return chunks, steps, rows, mini_batch_norms(chunks, loss_fn, steps=steps, **kw)


def token_micro_batches(
    batch: Mapping[str, torch.Tensor],
    *,
    budget: int,
    micro: int,
    accum: int,
    packed: bool,
    world_size: int,
    device: torch.device,
) -> tuple[list[dict[str, Any]], list[int], list[list[int]]]:
    """``batch`` as micro batches of about ``budget`` tokens each (``micro_batches``), each cut
    to its own longest row; the number of micro batches of each optimizer step (the same on
    every rank: the busiest rank's, the others splitting their biggest micro batches); and each
    micro batch's rows of ``batch``."""
    size = _common.batch_size_of(batch)
    rows_per_step = micro * accum
    split_micro_batches(batch, micro=micro, accum=accum)  # the size check
    widths = row_widths(batch["attention_mask"])
    plans = []
    for start in range(0, size, rows_per_step):
        step_widths = widths[start : start + rows_per_step]
        groups = plan_micro_batches(step_widths, budget, packed=packed)
        plans.append([[start + i for i in g] for g in groups])
    counts = torch.tensor([len(p) for p in plans], dtype=torch.long)
    if dist.is_initialized() and world_size > 1 and len(plans):
        counts = counts.to(device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    chunks, steps, rows = [], [], []
    for plan, count in zip(plans, counts.cpu().tolist(), strict=True):
        plan = match_count(plan, widths, count, packed=packed)
        if len(plan) != count:  # only when ranks hold different row counts per step
            raise ValueError(
                f"train_step: {len(plan)} rows cannot make the {count} micro batches another "
                "rank runs; every rank needs per_device_train_batch_size x "
                "gradient_accumulation_steps rows per optimizer step"
            )
        chunks += [select_rows(batch, g, width=max(widths[i] for i in g)) for g in plan]
        steps.append(count)
        rows += plan
    return chunks, steps, rows


def mini_batch_norms(
    chunks: list[dict[str, Any]],
    loss_fn: LossFn,
    *,
    steps: list[int],
    world_size: int,
    device: torch.device,
    replicas: int = 1,
) -> list[MiniBatchNorm] | None:
    """One ``MiniBatchNorm`` per optimizer step of ``chunks`` (``steps[k]`` consecutive micro
    batches each): the counts of the whole mini-batch, summed over this rank's micro batches and
    all-reduced over the data-parallel ranks (one collective per train step), and the scale
    ``steps[k] x world_size`` that undoes the trainer's averaging. None for a loss without
    ``mini_batch_counts``. ``replicas``: ranks holding the same micro batches (an SP group):
    the all-reduced counts and the scale are divided by it (each of those ranks' losses is
    multiplied by it, ``SequenceParallel.loss_factor``)."""
    counts_of = getattr(loss_fn, "mini_batch_counts", None)
    if counts_of is None:
        return None
    starts = [sum(steps[:k]) for k in range(len(steps))]
    per_step = torch.stack(
        [
            torch.stack([counts_of(mb) for mb in chunks[start : start + n]]).sum(0)
            for start, n in zip(starts, steps, strict=True)
        ]
    ).to(torch.float64)
    if dist.is_initialized() and world_size > 1:
        per_step = per_step.to(device)
        dist.all_reduce(per_step)
    per_step = per_step / replicas
    return [
        MiniBatchNorm(tokens=tokens, sequences=sequences, scale=float(n * world_size / replicas))
        for (tokens, sequences), n in zip(per_step.cpu().tolist(), steps, strict=True)
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
    taken, the LR of the last one and the mean gradient norm of those that report one and were
    applied (a step DeepSpeed skips for an overflow has an infinite or NaN norm: it is counted
    in ``train/overflow_steps`` instead)."""

    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)

    def add_micro_batch(self, loss: torch.Tensor, metrics: Mapping[str, Any]) -> None:
        for k, v in {"loss": loss.detach().float().item(), **metrics}.items():
            value = v.detach().float().item() if isinstance(v, torch.Tensor) else float(v)
            self.sums[k] = self.sums.get(k, 0.0) + value

    def add_optimizer_step(self, norm: float | None, *, applied: bool = True) -> None:
        self.steps += 1
        if norm is not None and applied:
            self.grad_norms.append(float(norm))

    def result(self, micro_batches: int) -> dict[str, float]:
        result = {k: v / micro_batches for k, v in self.sums.items()}
        result["optimizer_steps"] = float(self.steps)
        result["lr"] = self.lrs[-1]
        if self.grad_norms:
            result["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return result


def loss_scale_metrics(engine: Any) -> dict[str, float]:
    """``train/overflow_steps``: the optimizer steps DeepSpeed has skipped since the run began
    (an fp16 overflow, or a NaN/inf gradient norm in any precision; the engine counts them in
    ``skipped_steps`` and checkpoints the count); under fp16 also ``train/loss_scale``: the
    dynamic loss scale after the last step (the optimizer's scaler, checkpointed with its
    states)."""
    metrics = {"train/overflow_steps": float(engine.skipped_steps)}
    if engine.fp16_enabled():
        # DeepSpeed's own reader (it logs the same value to its monitor as loss_scale)
        metrics["train/loss_scale"] = float(engine._get_optimizer_loss_scale())
    return metrics


def dropout_free(module: torch.nn.Module) -> bool:
    """Whether a train-mode forward of ``module`` drops nothing: every ``nn.Dropout`` at p=0
    and every ``*dropout*`` rate of its HF config 0 (attention dropout is a functional call)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()):
        return False
    config = getattr(module, "config", None)
    rates = config.to_dict() if hasattr(config, "to_dict") else {}
    return not any(v for k, v in rates.items() if "dropout" in k and isinstance(v, int | float))


def head_forward(
    model: Any,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    head: str,
    packed: bool,
    temperature: float,
    with_entropy: bool = False,
    sp: SequenceParallel | None = None,
) -> dict[str, torch.Tensor]:
    """``{"logprobs_BT"[, "entropy_BT"]}`` at ``temperature`` of an ``lm`` head, or
    ``{"values_BT"}`` of a ``value`` head (``packed``: the rows packed into one, no padding;
    ``sp``: this rank computing its share of the columns)."""
    if sp is not None:
        if head != "lm":
            raise ValueError("sequence parallelism computes log-probs only (head='lm')")
        kw = {"with_entropy": with_entropy, "temperature": temperature, "packed": packed}
        return sp.forward_logprobs(model, input_ids_BT, attention_mask_BT, **kw)
    if head == "value":
        if with_entropy:
            raise ValueError("a value model has no token distribution (with_entropy=True)")
        if packed:
            rows = PackedRows.of(attention_mask_BT)
            values_M = packed_forward(model, input_ids_BT, rows)[:, 0].float()
            return {"values_BT": rows.unpack(values_M)}
        return {"values_BT": forward_values(model, input_ids_BT, attention_mask_BT)}
    return _common.forward_logprobs(
        model,
        input_ids_BT,
        attention_mask_BT,
        with_entropy=with_entropy,
        temperature=temperature,
        packed=packed,
    )
