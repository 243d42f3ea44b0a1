"""PPO epochs: the train step's ``algorithm.ppo_epochs`` passes over one rollout batch.

The old log-probs (and the critic's old values) are columns of the batch, computed once before
the first pass, so every pass clips against the same behaviour policy. Pass 0 takes the rows in
rollout order (``ppo_epochs: 1`` is exactly the plain single pass); each later pass takes its own
permutation from a generator seeded by ``(seed, pass)``, so a resumed run repeats it.

A training role's LR schedule spans every optimizer step of the run (``schedule_steps``): each
pass makes one per ``per_device_train_batch_size x gradient_accumulation_steps x world size``
rows.

A role with ``max_tokens_per_micro_batch`` cuts its rows into micro-batches by tokens, and every
rank runs as many as the busiest; so its rows are dealt to the ranks by tokens first
(``balance_ranks``): within each optimizer step, the longest rows first, each to the rank with
the fewest tokens so far, equal row counts. Which rows make an optimizer step does not change,
so neither does the gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.model_roles import TrainingRole

SUMMED = ("optimizer_steps",)  # counted over passes; every other metric is averaged
# the LR, the fp16 loss scale and the run's skipped-step count after the last pass
LAST = ("lr", "train/loss_scale", "train/overflow_steps")


def pass_orders(num_rows: int, ppo_epochs: int, seed: int) -> list[list[int]]:
    """Row order of each pass: identity first, then seeded permutations."""
    if ppo_epochs < 1:
        raise ValueError(f"algorithm.ppo_epochs must be >= 1, got {ppo_epochs}")
    orders = [list(range(num_rows))]
    for epoch in range(1, ppo_epochs):
        generator = torch.Generator().manual_seed(seed * 1_000 + epoch)
        orders.append(torch.randperm(num_rows, generator=generator).tolist())
    return orders


def balance_ranks(
    order: Sequence[int], tokens: Sequence[int], *, world_size: int, rows_per_step: int
) -> list[int]:
    """``order`` rearranged so that each of the ``world_size`` consecutive rank chunks holds
    about the same tokens in every optimizer step (``rows_per_step`` rows per rank), and the
    same rows per step as before. ``tokens``: per row index. Orders that do not split into
    whole steps per rank are returned unchanged."""
    n = len(order)
    if world_size < 2 or rows_per_step < 1 or n % (world_size * rows_per_step):
        return list(order)
    per_rank = n // world_size
    out = list(order)
    for start in range(0, per_rank, rows_per_step):
        slots = [
            list(range(r * per_rank + start, r * per_rank + start + rows_per_step))
            for r in range(world_size)
        ]
        rows = sorted((order[i] for rank in slots for i in rank), key=lambda i: -tokens[i])
        filled = [0] * world_size
        load = [0] * world_size
        for row in rows:
            rank = min(
                (r for r in range(world_size) if filled[r] < rows_per_step),
                key=lambda r: (load[r], r),
            )
            out[slots[rank][filled[rank]]] = row
            filled[rank] += 1
            load[rank] += tokens[row]
    return out


def merge_pass_metrics(per_pass: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One metrics dict for the step: ``optimizer_steps`` summed over passes, ``lr`` the last
    pass's, every other key averaged over the passes that report it."""
    merged: dict[str, float] = {}
    keys = sorted(set().union(*per_pass)) if per_pass else []
    for key in keys:
        values = [m[key] for m in per_pass if key in m]
        if key in SUMMED:
            merged[key] = sum(values)
        elif key in LAST:
            merged[key] = values[-1]
        else:
            merged[key] = sum(values) / len(values)
    return merged


def train_passes(
    trainers: Mapping[str, TrainingRole],
    batch: Batch,
    jobs: Mapping[str, tuple[Sequence[str], Any]],
    *,
    ppo_epochs: int,
    seed: int,
    balance: Mapping[str, int] | None = None,
    fill_old_logprobs: bool = False,
) -> dict[str, float]:
    """``ppo_epochs`` passes of every training role in ``jobs`` (``{role: (columns, loss_fn)}``)
    over ``batch``, the roles side by side on the same row order; a role in ``balance``
    (``{role: rows per rank per optimizer step}``) gets it dealt by tokens (``balance_ranks``).
    ``fill_old_logprobs`` (one pass): the actor's train step computes the batch's
    ``old_logprobs`` as it trains (``train_step_with_old_logprobs``) and they are added to
    ``batch`` in its own row order. Metrics: ``actor_train``'s as the strategy and loss name
    them (``grad_norm``, ``lr``, ``train/*``, ``perf/*``, ``actor/*``), the critic's under
    ``critic/``."""
    if fill_old_logprobs and ppo_epochs != 1:
        raise ValueError("old log-probs come from the train step only in a single pass")
    parts = {
        name: batch.select(*[k for k in keys if k in batch], meta=False)
        for name, (keys, _) in jobs.items()
    }
    per_pass: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
    balance = balance or {}
    tokens = batch["attention_mask"].sum(-1).tolist() if balance else []
    for order in pass_orders(len(batch), ppo_epochs, seed):
        orders = {
            name: balance_ranks(
                order, tokens, world_size=trainers[name].world_size, rows_per_step=balance[name]
            )
            if name in balance
            else order
            for name in jobs
        }
        calls = {
            name: trainers[name].train_step(
                parts[name].index(orders[name]),
                loss_fn,
                fill_old_logprobs=fill_old_logprobs and name == "actor_train",
            )
            for name, (_, loss_fn) in jobs.items()
        }
        for name, call in calls.items():
            result = call.get()
            if result.old_logprobs is not None:  # rows in the order this pass sent them
                old = torch.empty_like(result.old_logprobs)
                old[torch.as_tensor(orders[name])] = result.old_logprobs
                batch.tensors["old_logprobs"] = old
            per_pass[name].append(_mean_dicts(result.rank_metrics))
    metrics = merge_pass_metrics(per_pass["actor_train"])
    if "critic" in jobs:
        critic = merge_pass_metrics(per_pass["critic"])
        # the value loss names its own critic/*; the trainer's (grad_norm, train/*, perf/*) get
        # the prefix, so the actor's keep theirs
        metrics.update(
            {k if k.startswith("critic/") else f"critic/{k}": v for k, v in critic.items()}
        )
    return metrics


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each key over the dicts that have it (one dict per data-parallel rank)."""
    keys = set().union(*dicts) if dicts else set()
    return {k: sum(d[k] for d in dicts if k in d) / sum(k in d for d in dicts) for k in keys}


def schedule_steps(cfg: RLVRConfig, role: str) -> int:
    """Optimizer steps ``role`` (actor_train or critic) makes over the run: ``max_steps`` x
    ``ppo_epochs`` x the steps of one pass over ``rollout_batch_size x group`` rows."""
    from roll_ds.config.role_placement import placement

    role_cfg = getattr(cfg, role)
    args = role_cfg.training_args
    rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    world_size = placement(role, role_cfg).world_size
    rows = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    per_pass = max(1, rows // (rows_per_step * world_size))
    return cfg.max_steps * cfg.algorithm.ppo_epochs * per_pass
