"""ZeRO-aware pieces the DeepSpeed strategies share (``train``, ``infer``): chunked forwards
that keep ZeRO-3's parameter gathers paired across ranks, the re-partitioning after out-of-trace
forwards, the barrier that ends a rank-0 write, and the strategy config as a plain dict."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from roll_ds.config.plain import plain_dict
from strategies import _common
from strategies.deepspeed.sequence_parallel import SequenceParallel, group_budget, over_rows
from strategies.micro_batches import token_batched_forward


def batched_logprobs(
    model: Any,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    batch_size: int,
    with_entropy: bool,
    device: torch.device,
    lockstep: bool,
    temperature: float = 1.0,
    max_tokens: int | None = None,
    packed: bool = False,
    sp: SequenceParallel | None = None,
) -> dict[str, torch.Tensor]:
    """Log-probs (and entropy) in chunks of ``batch_size`` rows or ``max_tokens`` tokens, each
    ``packed`` or not; see ``batched_forward``. ``sp``: over the SP group's rows, each chunk's
    columns shared by its ranks (``sequence_parallel.over_rows``)."""
    forward = _common.forward_logprobs if sp is None else sp.forward_logprobs
    run = functools.partial(
        batched_forward,
        lambda ids, mask: forward(
            model, ids, mask, with_entropy=with_entropy, temperature=temperature, packed=packed
        ),
        batch_size=batch_size,
        device=device,
        lockstep=lockstep,
        empty_keys=("logprobs_BT", "entropy_BT") if with_entropy else ("logprobs_BT",),
        max_tokens=group_budget(sp, max_tokens),
        packed=packed,
    )
    return over_rows(sp, run, input_ids_BT, attention_mask_BT)


def batched_forward(
    forward: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device,
    lockstep: bool,
    empty_keys: tuple[str, ...],
    max_tokens: int | None = None,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    """``forward(ids, mask)`` in chunks of ``batch_size``, outputs concatenated on the CPU (the
    ``empty_keys``, ``[0, T-1]``, when this rank has no rows). With ``lockstep`` (ZeRO-3 over
    several ranks) every rank runs as many forwards as the busiest one, since each forward
    all-gathers parameters. ``max_tokens``: chunks by tokens instead (``token_batched_forward``;
    ``packed`` says how a chunk's tokens count)."""
    if max_tokens is not None:
        return token_batched_forward(
            forward,
            input_ids_BT,
            attention_mask_BT,
            max_tokens=max_tokens,
            packed=packed,
            device=device,
            lockstep=lockstep,
            empty_keys=empty_keys,
        )
    n = input_ids_BT.shape[0]
    spans = list(_common.iter_chunks(n, batch_size))
    rounds = len(spans)
    if lockstep:
        count = torch.tensor([rounds], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        rounds = int(count.item())
    parts: dict[str, list[torch.Tensor]] = {}
    for i in range(rounds):
        start, stop = spans[i] if i < len(spans) else spans[-1] if spans else (0, 0)
        if stop == start:  # this rank has no rows at all: a 1-row dummy keeps the gathers paired
            ids = torch.zeros((1, max(2, input_ids_BT.shape[1])), dtype=torch.long)
            mask = torch.ones_like(ids)
        else:
            ids, mask = input_ids_BT[start:stop], attention_mask_BT[start:stop]
        out = forward(ids.to(device), mask.to(device))
        if i < len(spans):
            for k, v in out.items():
                parts.setdefault(k, []).append(v.float().cpu())
    if not parts:
        width = max(0, input_ids_BT.shape[1] - 1)
        return {k: torch.zeros((0, width)) for k in empty_keys}
    return {k: torch.cat(v) for k, v in parts.items()}


def release_zero3_params(engine: Any) -> None:
    """Wait for ZeRO-3 prefetches still in flight and re-partition every parameter. Forwards
    whose module order differs from the recorded trace (inference after training, the padding
    forwards of ``batched_logprobs``) can leave prefetched parameters in flight, which a
    following ``GatheredParameters`` refuses ("Cannot partition a param in flight")."""
    if engine.zero_optimization_stage() == 3 and hasattr(engine.optimizer, "empty_partition_cache"):
        # engine.empty_partition_cache() does this plus a gc.collect() that cost 250-280 ms per
        # call here (most of a small-model sync); the re-partitioning is all that is needed.
        engine.optimizer.empty_partition_cache()


def plain_strategy_config(config: Any) -> dict[str, Any]:
    """An OmegaConf node or mapping as a plain dict (DeepSpeed wants JSON-like values)."""
    if config is None:
        raise ValueError("strategy_args.strategy_config is null; use e.g. ${deepspeed_zero3}")
    return plain_dict(config)


def barrier() -> None:
    """Wait for every rank (a no-op without a process group of several ranks)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
