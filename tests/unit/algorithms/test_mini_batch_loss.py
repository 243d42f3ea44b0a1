"""Mini-batch loss normalization (issue 10): per-micro-batch losses, scaled by MiniBatchNorm and
averaged the way DeepSpeed averages them, equal the loss of the whole mini-batch, by hand."""

from __future__ import annotations

import pytest
import torch

from roll_ds.algorithms.aggregation import AGG_MODES, MiniBatchNorm, mini_batch_counts
from roll_ds.config.schema import AlgorithmConfig
from roll_ds.pipeline.loss_fns import PolicyLoss, ValueLoss

MODES = sorted(AGG_MODES.names())


def _batch(lengths: list[int], width: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), width)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    return {
        "response_mask": mask,
        "loss_mask": mask.clone(),
        "old_logprobs": -1.0 + 0.1 * torch.randn(len(lengths), width, generator=g),
        "advantages": torch.randn(len(lengths), 1, generator=g).expand(-1, width).contiguous(),
        "values": torch.randn(len(lengths), width, generator=g),
        "returns": torch.randn(len(lengths), width, generator=g),
    }


def _rows(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def _split_loss(loss_fn, logprobs_BT, batch, micro: int, ranks: int) -> torch.Tensor:
    """What the gradient sees after DeepSpeed: mean over ranks of sum over micro batches of
    loss / accumulation, with the mini-batch norm of all ranks' micro batches."""
    size = logprobs_BT.shape[0]
    accum = size // (micro * ranks)
    tokens, sequences = loss_fn.mini_batch_counts(batch).tolist()
    norm = MiniBatchNorm(tokens, sequences, scale=accum * ranks)
    total = torch.zeros(())
    for start in range(0, size, micro):
        rows = slice(start, start + micro)
        loss, _ = loss_fn(logprobs_BT[rows], _rows(batch, rows), norm=norm)
        total = total + loss / accum
    return total / ranks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("micro,ranks", [(1, 1), (2, 2), (4, 1), (1, 4)])
def test_policy_loss_over_micro_batches_equals_the_whole_mini_batch(mode, micro, ranks):
    lengths = [1, 8, 2, 7, 0, 3, 8, 1]  # one empty row (masked out entirely)
    batch = _batch(lengths)
    algo = AlgorithmConfig(loss_agg_mode=mode, kl_coef=0.0)
    loss_fn = PolicyLoss.from_config(algo, response_length=8)
    logprobs = batch["old_logprobs"] + 0.05
    whole, _ = loss_fn(logprobs, batch)  # no norm: the batch normalized on its own
    assert float(_split_loss(loss_fn, logprobs, batch, micro, ranks)) == pytest.approx(
        float(whole), rel=1e-6
    )


def test_token_mean_by_hand_and_the_old_bias():
    # Two micro batches: 1 token with loss 1, and 3 tokens with loss 0 each. Mini-batch token
    # mean: 1/4. The old per-micro-batch mean of means: (1 + 0) / 2 = 1/2.
    loss_BT = torch.tensor([[1.0, 0, 0], [0.0, 0, 0]])
    mask_BT = torch.tensor([[1.0, 0, 0], [1.0, 1, 1]])
    counts = mini_batch_counts(mask_BT)
    assert counts.tolist() == [4.0, 2.0]
    norm = MiniBatchNorm(*counts.tolist(), scale=2)  # accumulation 2
    from roll_ds.algorithms.aggregation import aggregate_loss

    per_micro = [
        norm.apply(aggregate_loss(loss_BT[i : i + 1], mask_BT[i : i + 1], denominator=4.0)) / 2
        for i in range(2)
    ]
    assert float(sum(per_micro)) == pytest.approx(0.25)
    old = sum(aggregate_loss(loss_BT[i : i + 1], mask_BT[i : i + 1]) / 2 for i in range(2))
    assert float(old) == pytest.approx(0.5)


def test_sequence_modes_count_sequences_and_empty_minibatch_is_zero():
    norm = MiniBatchNorm(tokens=10, sequences=3, scale=4)
    assert norm.denominator("token-mean") == 10
    assert norm.denominator("seq-mean-token-sum") == 3
    assert norm.denominator("seq-mean-token-sum-norm") == 3
    assert MiniBatchNorm(tokens=0, sequences=0).denominator("token-mean") == 1.0
    with pytest.raises(ValueError, match="token-meen"):
        norm.denominator("token-meen")


def test_policy_loss_metrics_average_to_the_mini_batch_loss():
    batch = _batch([1, 8, 2, 7])
    loss_fn = PolicyLoss.from_config(AlgorithmConfig(), response_length=8)
    logprobs = batch["old_logprobs"] + 0.05
    _, whole_metrics = loss_fn(logprobs, batch)
    tokens, sequences = loss_fn.mini_batch_counts(batch).tolist()
    norm = MiniBatchNorm(tokens, sequences, scale=4)  # 4 micro batches of 1 row
    parts = [
        loss_fn(logprobs[i : i + 1], _rows(batch, slice(i, i + 1)), norm=norm) for i in range(4)
    ]
    mean_pg = sum(m["actor/pg_loss"] for _, m in parts) / 4
    assert mean_pg == pytest.approx(whole_metrics["actor/pg_loss"], rel=1e-6)


def test_value_loss_over_micro_batches_equals_the_whole_mini_batch():
    batch = _batch([1, 8, 2, 7, 3, 3])
    algo = AlgorithmConfig(adv_estimator="gae", value_clip=None)
    loss_fn = ValueLoss.from_config(algo, response_length=8)
    values = batch["values"] + 0.3
    whole, _ = loss_fn(values, batch)
    assert float(_split_loss(loss_fn, values, batch, micro=2, ranks=1)) == pytest.approx(
        float(whole), rel=1e-6
    )


def test_loss_mask_drops_rows_from_the_policy_loss_only():
    batch = _batch([3, 3])
    batch["loss_mask"][1] = 0.0  # a truncated row under mask_truncated
    policy = PolicyLoss.from_config(AlgorithmConfig(), response_length=8)
    critic = ValueLoss.from_config(AlgorithmConfig(adv_estimator="gae"), response_length=8)
    assert policy.mini_batch_counts(batch).tolist() == [3.0, 1.0]
    assert critic.mini_batch_counts(batch).tolist() == [6.0, 2.0]
    logprobs = batch["old_logprobs"] + 0.05
    only_first, _ = policy(logprobs[:1], _rows(batch, slice(0, 1)))
    both, _ = policy(logprobs, batch)
    assert float(both) == pytest.approx(float(only_first), rel=1e-6)


def test_gspo_sequence_clip_range_comes_from_the_config():
    algo = AlgorithmConfig(ratio_level="sequence", seq_clip_low=0.1, seq_clip_high=0.2)
    loss_fn = PolicyLoss.from_config(algo, response_length=4)
    assert (loss_fn.seq_clip_low, loss_fn.seq_clip_high) == (0.1, 0.2)
    batch = _batch([4])
    batch["advantages"] = torch.ones(1, 8)
    # Sequence ratio exp(0.15) = 1.16: inside the configured 0.2 high clip, outside the paper's
    # 4e-4 default, so the clip fraction tells which range was used.
    _, metrics = loss_fn(batch["old_logprobs"] + 0.15, batch)
    assert metrics["actor/clipfrac"] == 0.0
    default = PolicyLoss.from_config(AlgorithmConfig(ratio_level="sequence"), response_length=4)
    _, metrics = default(batch["old_logprobs"] + 0.15, batch)
    assert metrics["actor/clipfrac"] == 1.0
