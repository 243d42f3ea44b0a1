"""GAE on the critic's values -> returns -> the critic's clipped value loss, by hand."""

import pytest
import torch

from roll_ds.config.schema import AlgorithmConfig
from roll_ds.pipeline.batch_advantages import batch_advantages
from roll_ds.pipeline.loss_fns import ValueLoss

# Row 0: 3 response tokens, score 1. Row 1: 2 tokens (column 2 is padding), score 0.
MASK_BT = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
OLD_VALUES_BT = torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.25, 123.0]])  # padding holds garbage
# gamma = lam = 0.5. Row 0: rewards [0, 0, 1] ->
#   A2 = 1 - 0.5 = 0.5; A1 = 0 + 0.5*0.5 - 0.25 + 0.25*0.5 = 0.125;
#   A0 = 0 + 0.5*0.25 - 0.5 + 0.25*0.125 = -0.34375; returns = A + V = [0.15625, 0.375, 1.0].
# Row 1: rewards [0, 0] -> A1 = -0.25; A0 = 0.5*0.25 - 0.5 + 0.25*(-0.25) = -0.4375;
#   returns [0.0625, 0.0].
ADV_BT = torch.tensor([[-0.34375, 0.125, 0.5], [-0.4375, -0.25, 0.0]])
RETURNS_BT = torch.tensor([[0.15625, 0.375, 1.0], [0.0625, 0.0, 0.0]])


def _batch(**extra):
    return {
        "scores": torch.tensor([1.0, 0.0]),
        "response_mask": MASK_BT,
        "old_logprobs": torch.zeros(2, 3),
        "rollout_logprobs": torch.zeros(2, 3),
        **extra,
    }


def test_gae_advantages_and_returns_from_critic_values():
    algo = AlgorithmConfig(adv_estimator="gae", gamma=0.5, lam=0.5)
    columns, metrics = batch_advantages(algo, _batch(values=OLD_VALUES_BT), group_size=2)
    assert sorted(columns) == ["advantages", "returns"]
    torch.testing.assert_close(columns["advantages"], ADV_BT)
    torch.testing.assert_close(columns["returns"], RETURNS_BT)
    assert metrics["critic/values_mean"] == pytest.approx(2.0 / 5)
    assert metrics["critic/returns_mean"] == pytest.approx(1.59375 / 5)
    assert metrics["actor/advantage_mean"] == pytest.approx(-0.40625 / 5)


def test_gae_whitened_advantages_keep_raw_returns():
    algo = AlgorithmConfig(adv_estimator="gae", gamma=0.5, lam=0.5, whiten_advantages=True)
    columns, metrics = batch_advantages(algo, _batch(values=OLD_VALUES_BT), group_size=2)
    valid = ADV_BT[MASK_BT.bool()]
    expected = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    torch.testing.assert_close(columns["advantages"][MASK_BT.bool()], expected)
    torch.testing.assert_close(columns["returns"], RETURNS_BT)
    assert metrics["actor/advantage_mean"] == pytest.approx(0.0, abs=1e-6)


def test_value_loss_against_gae_returns_with_clipping():
    algo = AlgorithmConfig(adv_estimator="gae", gamma=0.5, lam=0.5, value_clip=0.2, vf_coef=2.0)
    columns, _ = batch_advantages(algo, _batch(values=OLD_VALUES_BT), group_size=2)
    micro_batch = {"response_mask": MASK_BT, "values": OLD_VALUES_BT, **columns}
    new_values_BT = torch.tensor([[0.6, 0.25, 1.0], [0.5, 0.0, 7.0]])
    loss, metrics = ValueLoss.from_config(algo, response_length=3)(new_values_BT, micro_batch)
    # Squared errors (max of unclipped and clipped to old +- 0.2):
    #   row 0: 0.44375^2 = 0.1969140625; 0.125^2 = 0.015625; t2 1.0 -> clipped 0.7: 0.09 (clip)
    #   row 1: 0.4375^2 = 0.19140625; t1 0.0 -> clipped 0.05: 0.0025 (clip)
    value_loss = 0.5 * (0.1969140625 + 0.015625 + 0.09 + 0.19140625 + 0.0025) / 5
    assert metrics["critic/value_loss"] == pytest.approx(value_loss)
    assert loss.item() == pytest.approx(2.0 * value_loss)  # vf_coef
    assert metrics["critic/vf_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["critic/vpred_mean"] == pytest.approx((0.6 + 0.25 + 1.0 + 0.5 + 0.0) / 5)
    assert not ValueLoss.from_config(algo, 3).needs_entropy


def test_value_loss_is_zero_when_values_already_equal_returns():
    algo = AlgorithmConfig(adv_estimator="gae", gamma=0.5, lam=0.5)
    columns, _ = batch_advantages(algo, _batch(values=OLD_VALUES_BT), group_size=2)
    micro_batch = {"response_mask": MASK_BT, "values": OLD_VALUES_BT, **columns}
    loss, _ = ValueLoss.from_config(algo, 3)(columns["returns"].clone(), micro_batch)
    assert loss.item() == 0.0


def test_outcome_estimators_make_no_returns_column():
    columns, metrics = batch_advantages(AlgorithmConfig(), _batch(), group_size=2)
    assert sorted(columns) == ["advantages"]
    assert not any(k.startswith("critic/") for k in metrics)


def test_gae_without_critic_values_fails_naming_them():
    with pytest.raises(KeyError, match="needs the critic's 'values'"):
        batch_advantages(AlgorithmConfig(adv_estimator="gae"), _batch(), group_size=2)
