"""The training losses, built from ``AlgorithmConfig`` and shipped to the training workers:
``PolicyLoss`` for the actor, ``ValueLoss`` for the critic (adv_estimator gae).

Frozen dataclasses (picklable, no closures) called by the strategy once per micro batch with the
trainer's fresh log-probs (values, for the critic); everything else they read travels in the
micro batch.

Both normalize over the whole optimizer-step mini-batch: the strategy sums
``mini_batch_counts(micro_batch)`` over the micro-batches of an optimizer step and over the
data-parallel ranks, and passes the result as ``norm`` (``algorithms.aggregation.MiniBatchNorm``).
The actor's loss reads ``loss_mask`` (the response mask less truncated rows under
``mask_truncated``); the critic's reads ``response_mask`` (it keeps learning truncated rows'
values). The actor's per-token policy-gradient loss is weighted by the rollout correction
(``algorithm.rollout_correction``, ``algorithms.corrections``); tokens it masks get weight 0 and
still count in the mini-batch counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from roll_ds.algorithms.aggregation import MiniBatchNorm, aggregate_loss, mini_batch_counts
from roll_ds.algorithms.corrections import Correction, CorrectionParams, rollout_correction
from roll_ds.algorithms.kl import kl_loss
from roll_ds.algorithms.policy_loss import ppo_policy_loss
from roll_ds.algorithms.value_loss import value_loss
from roll_ds.config.schema import AlgorithmConfig

ASYNC_TIS_CAP = 2.0  # algorithm.tis_cap when it is null under async_generation

# What the training workers need of a batch (PolicyLoss reads these columns).
TRAIN_KEYS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "loss_mask",
    "old_logprobs",
    "advantages",
    "ref_logprobs",
    "rollout_logprobs",
)
# What the critic's workers need (ValueLoss reads these columns).
CRITIC_KEYS = ("input_ids", "attention_mask", "response_mask", "values", "returns")


@dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    clip_low: float
    clip_high: float
    dual_clip: float | None
    ratio_level: str
    seq_clip_low: float = 3e-4  # ratio_level="sequence" (GSPO)
    seq_clip_high: float = 4e-4
    agg_mode: str
    kl_coef: float  # > 0 with use_kl_loss: KL to the reference as a loss term
    kl_estimator: str
    entropy_coef: float
    tis_cap: float | None  # token_tis / seq_tis cap; alone: token_tis (the pre-registry TIS)
    # A name in algorithms.corrections.CORRECTIONS; None: token_tis where tis_cap is set.
    rollout_correction: str | None = None
    correction_low: float | None = None  # icepop / geo_mask bounds; None: the correction's
    correction_high: float | None = None
    norm_constant: float | None = None  # seq-mean-token-sum-norm: the response length budget

    @classmethod
    def from_config(
        cls, algo: AlgorithmConfig, response_length: int, *, played_ahead: bool = False
    ) -> PolicyLoss:
        """The loss ``algorithm`` describes; ``played_ahead`` (``async_generation``): stale
        rollouts are corrected by token TIS at ``ASYNC_TIS_CAP`` unless ``tis_cap`` says
        otherwise."""
        tis_cap = algo.tis_cap
        if tis_cap is None and played_ahead:
            tis_cap = ASYNC_TIS_CAP
        return cls(
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
            ratio_level=algo.ratio_level,
            seq_clip_low=algo.seq_clip_low,
            seq_clip_high=algo.seq_clip_high,
            agg_mode=algo.loss_agg_mode,
            kl_coef=algo.kl_coef if algo.use_kl_loss and not algo.kl_in_reward else 0.0,
            kl_estimator=algo.kl_estimator,
            entropy_coef=algo.entropy_coef,
            tis_cap=tis_cap,
            rollout_correction=algo.rollout_correction,
            correction_low=algo.correction_low,
            correction_high=algo.correction_high,
            norm_constant=float(response_length),
        )

    @property
    def correction(self) -> str | None:
        """The rollout correction this loss applies (None: none)."""
        if self.rollout_correction is not None:
            return self.rollout_correction
        return "token_tis" if self.tis_cap is not None else None

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0

    def mini_batch_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[tokens, sequences]`` of this micro batch that the loss averages over."""
        return mini_batch_counts(_loss_mask(batch))

    def __call__(
        self,
        logprobs_BT: torch.Tensor,
        batch: dict[str, Any],
        entropy_BT: torch.Tensor | None = None,
        *,
        norm: MiniBatchNorm | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro batch's share of the mini-batch loss (``norm``; None: the micro batch
        normalized on its own) and metrics. Loss values in the metrics are scaled like the
        returned loss, so their mean over micro batches and ranks is the mini-batch's loss."""
        mask_BT = _loss_mask(batch)
        denominator = norm.denominator(self.agg_mode) if norm is not None else None
        scale = norm.scale if norm is not None else 1.0
        correction = self._rollout_correction(batch, mask_BT)
        loss, metrics = ppo_policy_loss(
            logprobs_BT,
            batch["old_logprobs"],
            batch["advantages"],
            mask_BT,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            ratio_level=self.ratio_level,
            seq_clip_low=self.seq_clip_low,
            seq_clip_high=self.seq_clip_high,
            agg_mode=self.agg_mode,
            norm_constant=self.norm_constant,
            denominator=denominator,
            is_weights_BT=correction.weights_BT if correction is not None else None,
        )
        out = {f"actor/{k}": float(v) for k, v in metrics.items()}
        if correction is not None:  # how much it reweights / masks the rollout (on-policy: 1 / 0)
            out |= {f"actor/correction_{k}": float(v) for k, v in correction.metrics.items()}
            if self.correction == "token_tis":  # its name before the registry
                out["actor/tis_weight_mean"] = out["actor/correction_weight_mean"]
        out["actor/pg_loss"] = float(loss.detach()) * scale
        if self.kl_coef > 0:
            kl = self._kl_to_reference(logprobs_BT, batch["ref_logprobs"], mask_BT, denominator)
            loss = loss + self.kl_coef * kl
            out["actor/kl_loss"] = float(kl.detach()) * scale
        if entropy_BT is not None:
            entropy = aggregate_loss(
                entropy_BT,
                mask_BT,
                self.agg_mode,
                norm_constant=self.norm_constant,
                denominator=denominator,
            )
            out["actor/entropy"] = float(entropy.detach()) * scale
            if self.entropy_coef:
                loss = loss - self.entropy_coef * entropy
        return loss * scale, out

    def _rollout_correction(
        self, batch: dict[str, Any], mask_BT: torch.Tensor
    ) -> Correction | None:
        """Weights on the per-token policy loss for pi_rollout != pi_old (None: no correction).
        Masked tokens get weight 0 and stay in the denominator (``mini_batch_counts``)."""
        if self.correction is None:
            return None
        params = CorrectionParams(
            cap=self.tis_cap, low=self.correction_low, high=self.correction_high
        )
        return rollout_correction(
            self.correction, batch["old_logprobs"], batch["rollout_logprobs"], mask_BT, params
        )

    def _kl_to_reference(
        self,
        logprobs_BT: torch.Tensor,
        ref_logprobs_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        denominator: float | None,
    ) -> torch.Tensor:
        """The KL loss term (``use_kl_loss``), aggregated like the policy loss."""
        return kl_loss(
            logprobs_BT,
            ref_logprobs_BT,
            mask_BT,
            estimator=self.kl_estimator,
            agg_mode=self.agg_mode,
            norm_constant=self.norm_constant,
            denominator=denominator,
        )


@dataclass(frozen=True, kw_only=True)
class ValueLoss:
    """``vf_coef`` x the clipped value loss of the critic's fresh values against the GAE returns,
    clipped around the values of rollout time (micro-batch columns ``values``, ``returns``)."""

    clip_range: float | None
    coef: float
    agg_mode: str
    norm_constant: float | None = None
    needs_entropy: bool = False

    @classmethod
    def from_config(cls, algo: AlgorithmConfig, response_length: int) -> ValueLoss:
        return cls(
            clip_range=algo.value_clip,
            coef=algo.vf_coef,
            agg_mode=algo.loss_agg_mode,
            norm_constant=float(response_length),
        )

    def mini_batch_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[tokens, sequences]`` of this micro batch that the loss averages over."""
        return mini_batch_counts(batch["response_mask"])

    def __call__(
        self,
        values_BT: torch.Tensor,
        batch: dict[str, Any],
        entropy_BT: torch.Tensor | None = None,
        *,
        norm: MiniBatchNorm | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        scale = norm.scale if norm is not None else 1.0
        loss, metrics = value_loss(
            values_BT,
            batch["values"],
            batch["returns"],
            batch["response_mask"],
            clip_range=self.clip_range,
            agg_mode=self.agg_mode,
            norm_constant=self.norm_constant,
            denominator=norm.denominator(self.agg_mode) if norm is not None else None,
        )
        out = {
            "critic/value_loss": float(loss.detach()) * scale,
            "critic/vf_clipfrac": float(metrics["vf_clipfrac"]),
            "critic/vpred_mean": float(metrics["vpred_mean"]),
        }
        return self.coef * loss * scale, out


def _loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The actor's loss mask: ``loss_mask`` where the pipeline set one, else the response mask."""
    return batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]
