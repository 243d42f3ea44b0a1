"""The log-prob phase of one RLVR step: the batch's ``old_logprobs`` (recomputed by the
trainer, or the rollout's: ``algorithm.old_logprobs``), ``ref_logprobs`` (kl_coef > 0) and,
with a critic, the critic's ``values``.

Recomputed old log-probs are left to the train step where nothing reads them before it
(``old_logprobs_in_train_step``): its first optimizer step's rows then take their train
forward's own log-probs, so only the later steps' rows cost a forward (``deepspeed_train``'s
``train_step_with_old_logprobs``); the batch gets the column back from the train phase."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch

AUTO_REUSE_PARITY = 1e-4  # algorithm.old_logprobs=auto: the parity gap that proves reuse safe


def reuse_rollout_logprobs(cfg: RLVRConfig, *, staleness: float, last_parity: float | None) -> bool:
    """``algorithm.old_logprobs``: auto reuses the rollout's log-probs only where they are
    the trainer's numbers: an on-policy batch, fp32 on both sides, and the latest parity
    probe (``last_parity``) within ``AUTO_REUSE_PARITY``."""
    mode = cfg.algorithm.old_logprobs
    if mode != "auto":
        return mode == "rollout"
    dtypes = {cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype}
    return (
        staleness == 0
        and dtypes == {"fp32"}
        and last_parity is not None
        and last_parity <= AUTO_REUSE_PARITY
    )


def old_logprobs_in_train_step(cfg: RLVRConfig) -> bool:
    """Whether recomputed old log-probs can come from the train step: nothing reads them before
    it (no reference KL: ``kl_coef`` 0), one pass over the batch (``ppo_epochs`` 1: a later
    pass needs them fixed), on ``deepspeed_train``, no LoRA dropout (a train forward with
    dropout is not the old policy's; the strategy checks the model's own)."""
    train = cfg.actor_train
    return (
        cfg.algorithm.kl_coef == 0
        and cfg.algorithm.ppo_epochs == 1
        and train.strategy_args.strategy_name == "deepspeed_train"
        and not train.model_args.lora_dropout
    )


def reference_logprobs(clusters: Mapping[str, Any], inputs: Batch) -> Batch:
    """``ref_logprobs`` from the reference role, or (LoRA, no reference role) from the actor
    with its adapter disabled."""
    if "reference" in clusters:
        return clusters["reference"].compute_logprobs(inputs, key="ref_logprobs")
    return clusters["actor_train"].compute_logprobs(
        inputs, key="ref_logprobs", disable_adapter=True
    )


def fill_logprobs(
    batch: Batch,
    clusters: Mapping[str, Any],
    *,
    reuse: bool,
    use_critic: bool,
    kl_coef: float,
    in_train_step: bool = False,
) -> dict[str, float]:
    """Add ``old_logprobs`` (the rollout's where ``reuse``; none yet where ``in_train_step``:
    the train step fills them), ``ref_logprobs`` (``kl_coef`` > 0) and the critic's ``values``
    to ``batch``; the critic computes beside the actor."""
    inputs = batch.select("input_ids", "attention_mask", meta=False)
    values = clusters["critic"].submit("compute_values", inputs) if use_critic else None
    if reuse:
        batch.tensors["old_logprobs"] = batch["rollout_logprobs"].clone()
    elif not in_train_step:
        old = clusters["actor_train"].compute_logprobs(inputs, key="old_logprobs")
        batch.tensors.update(old.tensors)
    if kl_coef > 0:
        batch.tensors.update(reference_logprobs(clusters, inputs).tensors)
    if values is not None:
        batch.tensors.update(values.get().tensors)
    return {
        "actor/old_logprobs_recomputed": float(not reuse),
        "actor/old_logprobs_in_train_step": float(not reuse and in_train_step),
    }
