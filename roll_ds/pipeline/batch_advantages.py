"""The advantage phase of one RLVR step, as a pure function of the batch's columns.

Reads ``scores``, ``response_mask``, ``rollout_logprobs`` and, where present, ``old_logprobs``
(absent until the train step when it fills them), ``ref_logprobs`` (KL to the reference) and
``values`` (the critic's, for gae). Hands the estimator exactly the ``algorithm`` settings it
reads (``roll_ds.config.estimators``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from roll_ds.algorithms.advantages import AdvantageInputs, compute_advantages
from roll_ds.algorithms.kl import kl_penalty
from roll_ds.algorithms.masks import masked_mean
from roll_ds.algorithms.policy_loss import rollout_mismatch_metrics
from roll_ds.config.estimators import ESTIMATOR_OPTIONS, needs_critic
from roll_ds.config.schema import AlgorithmConfig


def mismatch_metrics(batch: Mapping[str, Tensor]) -> dict[str, float]:
    """``rollout/mismatch_*``: how far the rollout engine's log-probs are from the old ones."""
    mismatch = rollout_mismatch_metrics(
        batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    )
    return {f"rollout/{k}": float(v) for k, v in mismatch.items()}


def batch_advantages(
    algo: AlgorithmConfig, batch: Mapping[str, Tensor], group_size: int
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """``(columns, metrics)``: ``advantages`` ``[B, T-1]``, and ``returns`` (the critic's
    targets) when the estimator uses critic values; ``actor/*``, ``rollout/mismatch_*`` and
    ``critic/values_mean`` / ``critic/returns_mean`` metrics."""
    mask_BT = batch["response_mask"]
    metrics: dict[str, float] = {}
    kl_BT = None
    if "ref_logprobs" in batch:
        kl_BT = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_estimator)
        metrics["actor/ref_kl"] = float(masked_mean(kl_BT, mask_BT))
    uses = ESTIMATOR_OPTIONS[algo.adv_estimator]
    options: dict[str, Any] = {k: getattr(algo, k) for k in ("gamma", "lam") if k in uses}
    critic = needs_critic(algo.adv_estimator)
    if critic:
        if "values" not in batch:
            raise KeyError(f"adv_estimator {algo.adv_estimator!r} needs the critic's 'values'")
        options["values_BT"] = batch["values"]
    advantages_BT, returns_BT = compute_advantages(
        algo.adv_estimator,
        AdvantageInputs(
            scores_B=batch["scores"],
            response_mask_BT=mask_BT,
            group_size=group_size,
            kl_BT=kl_BT if algo.kl_in_reward else None,
            kl_coef=algo.kl_coef if algo.kl_in_reward else 0.0,
            whiten_advantages=algo.whiten_advantages,
            **options,
        ),
    )
    if "old_logprobs" in batch:  # else the train step fills them (and these metrics follow)
        metrics.update(mismatch_metrics(batch))
    metrics["actor/advantage_mean"] = float(masked_mean(advantages_BT, mask_BT))
    columns = {"advantages": advantages_BT}
    if critic:
        columns["returns"] = returns_BT
        metrics["critic/values_mean"] = float(masked_mean(batch["values"], mask_BT))
        metrics["critic/returns_mean"] = float(masked_mean(returns_BT, mask_BT))
    return columns, metrics
