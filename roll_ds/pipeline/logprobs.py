"""The log-prob phase of one step: the batch's ``old_logprobs``, ``ref_logprobs`` (kl_coef > 0)
and, with a critic, the critic's ``values``.

Where PPO's old log-probs come from is chosen once, at start (``OldLogprobs.from_config``):
``algorithm.old_logprobs`` recompute (a trainer forward), rollout (the engines' sampled-token
log-probs) or auto (the rollout's where they are provably the trainer's numbers: an on-policy
batch, fp32 on both sides, the latest parity check within ``AUTO_REUSE_PARITY``). Recomputed
ones come from the train step itself where nothing reads them before it (``in_train_step``):
its first optimizer step's rows take their train forward's own log-probs, so only the later
steps' rows cost a forward; the batch gets the column back from the train phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from roll_ds.config.schema import RLVRConfig
from roll_ds.config.strategies import STRATEGY_SPECS
from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.model_roles import ModelRole

AUTO_REUSE_PARITY = 1e-4  # algorithm.old_logprobs=auto: the parity gap that proves reuse safe


@dataclass(frozen=True)
class OldLogprobs:
    """Where a step's old log-probs come from (module doc)."""

    mode: str  # recompute | rollout | auto
    fp32: bool  # trainer and engines both fp32 (auto reuses only then)
    in_train_step: bool  # recomputed ones come from the train step's forwards

    @classmethod
    def from_config(cls, cfg: RLVRConfig) -> OldLogprobs:
        train = cfg.actor_train
        spec = STRATEGY_SPECS[train.strategy_args.strategy_name]
        return cls(
            mode=cfg.algorithm.old_logprobs,
            fp32={train.model_args.dtype, cfg.actor_infer.model_args.dtype} == {"fp32"},
            # nothing reads them before the train step (no reference KL), one pass over the
            # batch (a later pass needs them fixed), no LoRA dropout (a train forward with
            # dropout is not the old policy's; the strategy checks the model's own)
            in_train_step=(
                cfg.algorithm.kl_coef == 0
                and cfg.algorithm.ppo_epochs == 1
                and spec.old_logprobs_in_train_step
                and not train.model_args.lora_dropout
            ),
        )

    def reuse(self, *, staleness: float, last_parity: float | None) -> bool:
        """Whether this step's batch trains on the rollout's log-probs."""
        if self.mode != "auto":
            return self.mode == "rollout"
        return (
            staleness == 0
            and self.fp32
            and last_parity is not None
            and last_parity <= AUTO_REUSE_PARITY
        )


def reference_logprobs(roles: Mapping[str, ModelRole], inputs: Batch) -> Batch:
    """``ref_logprobs`` from the reference role, or (LoRA, no reference role) from the actor
    with its adapter disabled."""
    if "reference" in roles:
        return roles["reference"].compute_logprobs(inputs, key="ref_logprobs")
    return roles["actor_train"].compute_logprobs(inputs, key="ref_logprobs", disable_adapter=True)


def fill_logprobs(
    batch: Batch,
    roles: Mapping[str, ModelRole],
    *,
    reuse: bool,
    use_critic: bool,
    kl_coef: float,
    in_train_step: bool = False,
) -> dict[str, float]:
    """Add ``old_logprobs`` (the rollout's where ``reuse``; none yet where ``in_train_step``:
    the train step fills them), ``ref_logprobs`` (``kl_coef`` > 0) and the critic's ``values``
    to ``batch``; the critic computes beside the actor. ``roles``: ``model_roles.py``."""
    inputs = batch.select("input_ids", "attention_mask", meta=False)
    values = roles["critic"].compute_values(inputs) if use_critic else None
    if reuse:
        batch.tensors["old_logprobs"] = batch["rollout_logprobs"].clone()
    elif not in_train_step:
        old = roles["actor_train"].compute_logprobs(inputs, key="old_logprobs")
        batch.tensors.update(old.tensors)
    if kl_coef > 0:
        batch.tensors.update(reference_logprobs(roles, inputs).tensors)
    if values is not None:
        batch.tensors.update(values.get().tensors)
    return {
        "actor/old_logprobs_recomputed": float(not reuse),
        "actor/old_logprobs_in_train_step": float(not reuse and in_train_step),
    }
