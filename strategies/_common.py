"""Pieces every torch-based strategy shares (dtypes and position ids are the core's,
``roll_ds.models.tensors``): token log-probs and entropy from logits, the forward
pass that produces them, micro-batching, LR schedules and process-group setup.

Shapes: ``B`` batch, ``T`` sequence length, ``V`` vocabulary. Log-probs are those of
``input_ids[:, 1:]`` given the prefix, so they have ``T - 1`` columns (``logprobs_BT`` is
``[B, T-1]``); column ``t`` scores token ``t + 1``.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator, Mapping
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from roll_ds.algorithms.kl import entropy_from_logits  # the one masked implementation
from roll_ds.models.tensors import position_ids_from_mask
from strategies.micro_batches import PackedRows, packed_forward

# ---------------------------------------------------------------------------------------------
# log-probs and entropy


def logprobs_from_logits(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]`` per position, computed in fp32."""
    logits_BTV = logits_BTV.float()
    picked_BT = torch.gather(logits_BTV, -1, labels_BT.unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float; log-probs of softmax(logits / T) need T > 0."""
    if not temperature > 0:
        raise ValueError(
            f"logprob_temperature must be > 0, got {temperature} (greedy rollouts use 1.0)"
        )
    return float(temperature)


def forward_logprobs(
    model: Any,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    """Run a causal LM and return ``logprobs_BT`` (and ``entropy_BT``), both ``[B, T-1]``.

    ``model`` is anything called like an HF causal LM (a module, a DeepSpeed engine, a peft
    model). Gradients flow when the caller has them enabled. ``packed``: one forward over the
    rows' real tokens without padding (``micro_batches.PackedRows``), the outputs scattered
    back; columns whose next token is padding are then 0.
    """
    if packed:
        rows = PackedRows.of(attention_mask_BT)
        logits_MV = packed_forward(model, input_ids_BT, rows)
        labels_M = rows.pack(input_ids_BT)[0, rows.targets_M]
        return {
            key: rows.unpack(values_M)
            for key, values_M in _token_outputs(
                logits_MV, labels_M, with_entropy=with_entropy, temperature=temperature
            ).items()
        }
    out = model(
        input_ids=input_ids_BT,
        attention_mask=attention_mask_BT,
        position_ids=position_ids_from_mask(attention_mask_BT),
        use_cache=False,
    )
    return _token_outputs(
        out.logits[:, :-1], input_ids_BT[:, 1:], with_entropy=with_entropy, temperature=temperature
    )


def _token_outputs(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, *, with_entropy: bool, temperature: float
) -> dict[str, torch.Tensor]:
    if temperature != 1.0:
        logits_BTV = logits_BTV.float() / temperature
    result = {"logprobs_BT": logprobs_from_logits(logits_BTV, labels_BT)}
    if with_entropy:
        result["entropy_BT"] = entropy_from_logits(logits_BTV)
    return result


# ---------------------------------------------------------------------------------------------
# micro-batching


def batch_size_of(batch: Mapping[str, Any]) -> int:
    if "input_ids" not in batch:
        raise KeyError(f"batch needs 'input_ids'; got keys {sorted(batch)}")
    return int(batch["input_ids"].shape[0])


def split_batch(batch: Mapping[str, Any], micro_batch_size: int) -> list[dict[str, Any]]:
    """Cut every tensor whose first dimension is the batch size into chunks of
    ``micro_batch_size`` rows (the last chunk may be smaller); other values are shared."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    size = batch_size_of(batch)
    chunks = []
    for start in range(0, size, micro_batch_size):
        stop = min(start + micro_batch_size, size)
        chunks.append(
            {
                key: value[start:stop]
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size
                else value
                for key, value in batch.items()
            }
        )
    return chunks


def to_device(batch: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


# ---------------------------------------------------------------------------------------------
# learning-rate schedule

SCHEDULES = ("constant", "linear", "cosine")


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Multiplier of the base LR for optimizer step ``step`` (0-based): linear warmup
    ``1/w, 2/w, ..., 1`` over the first ``w = warmup_steps`` steps, then constant, or linear /
    cosine decay reaching 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}; valid: {', '.join(SCHEDULES)}")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, kind: str
) -> torch.optim.lr_scheduler.LambdaLR:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr_scheduler_type {kind!r}; valid: {', '.join(SCHEDULES)}")
    fn = partial(lr_lambda, warmup_steps=warmup_steps, total_steps=total_steps, kind=kind)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


# ---------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Join (or create) the default process group through DeepSpeed; returns (rank, world size).

    Reads the torchrun-style env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a
    process without it becomes a world of one. The backend comes from ``current_platform()``.
    ``timeout_s``: the group's collective timeout (``fault_tolerance.process_group_timeout_s``;
    None: DeepSpeed's default, 10 min or ``$DEEPSPEED_TIMEOUT``).
    """
    import deepspeed
    import torch.distributed as dist

    from roll_ds.platform import current_platform

    platform = current_platform()
    if not dist.is_initialized():
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        os.environ.setdefault("LOCAL_RANK", "0")
    if platform.is_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # DeepSpeed builds its deepspeed_shm_comm op here on CPU: stale build locks are cleared first
    # and lock waits bounded (strategies/deepspeed/ops.py)
    from strategies.deepspeed.ops import load_ops

    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    load_ops(
        lambda: deepspeed.init_distributed(
            dist_backend=platform.dist_backend, verbose=False, **kwargs
        )
    )
    return dist.get_rank(), dist.get_world_size()


def device() -> torch.device:
    from roll_ds.platform import current_platform

    return torch.device(current_platform().device(int(os.environ.get("LOCAL_RANK", "0"))))


def iter_chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(start + size, n)
