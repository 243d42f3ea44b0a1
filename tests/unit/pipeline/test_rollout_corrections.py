"""Rollout corrections in the actor's loss, and the trainer-vs-rollout mismatch metrics of every
step, by hand."""

import math

import pytest
import torch

from roll_ds.algorithms.aggregation import MiniBatchNorm
from roll_ds.config.schema import AlgorithmConfig
from roll_ds.pipeline.batch_advantages import batch_advantages
from roll_ds.pipeline.loss_fns import PolicyLoss

LN2 = math.log(2)


def _batch(log_ratios, advantages):
    """One sequence, logprobs == old (PPO ratio 1), rollout log-probs old - ``log_ratios``."""
    old_BT = torch.full((1, len(advantages)), -1.0, dtype=torch.float64)
    return {
        "response_mask": torch.ones_like(old_BT),
        "old_logprobs": old_BT,
        "rollout_logprobs": old_BT - torch.tensor([log_ratios], dtype=torch.float64),
        "advantages": torch.tensor([advantages], dtype=torch.float64),
    }


def _loss(algo, batch, **kw):
    loss_fn = PolicyLoss.from_config(AlgorithmConfig(**algo), response_length=3)
    logp_BT = batch["old_logprobs"].clone().requires_grad_()
    loss, metrics = loss_fn(logp_BT, batch, **kw)
    loss.backward()
    return loss.item(), logp_BT.grad, metrics


def test_icepop_masked_token_contributes_nothing_and_stays_in_the_denominator():
    # rho = 1, 2, 8; IcePop [0.5, 5] weighs 1, 2, 0. A = 1, -1, 3 and r = 1: per-token loss
    # -A * w = -1, 2, 0, token-mean over all 3 tokens (the masked one stays counted) = 1/3.
    batch = _batch([0.0, LN2, 3 * LN2], [1.0, -1.0, 3.0])
    loss, grad, m = _loss({"rollout_correction": "icepop"}, batch)
    assert loss == pytest.approx(1 / 3)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, 2 / 3, 0.0]], dtype=torch.float64))
    assert m["actor/correction_masked_fraction"] == pytest.approx(1 / 3)
    assert m["actor/correction_weight_mean"] == pytest.approx(1.0)
    assert "actor/tis_weight_mean" not in m
    # Whatever the masked token's advantage, the loss is the same.
    batch["advantages"][0, 2] = -100.0
    assert _loss({"rollout_correction": "icepop"}, batch)[0] == pytest.approx(1 / 3)


def test_masked_tokens_keep_the_mini_batch_counts():
    batch = _batch([0.0, LN2, 3 * LN2], [1.0, -1.0, 3.0])
    loss_fn = PolicyLoss.from_config(
        AlgorithmConfig(rollout_correction="geo_mask"), response_length=3
    )
    assert loss_fn.mini_batch_counts(batch).tolist() == [3, 1]
    # geo mean 2^(4/3) > 1.001: the sequence is masked, its loss is 0 under the mini-batch norm.
    loss, _, m = _loss({"rollout_correction": "geo_mask"}, batch, norm=MiniBatchNorm(6, 2))
    assert loss == 0.0
    assert m["actor/correction_masked_seq_fraction"] == 1.0


def test_tis_cap_alone_is_token_tis_with_that_cap():
    # rho = 1, 2, 8 capped at 1.5: 1, 1.5, 1.5; A = 1, -1, 3: (-1 + 1.5 - 4.5) / 3.
    batch = _batch([0.0, LN2, 3 * LN2], [1.0, -1.0, 3.0])
    legacy, _, m = _loss({"tis_cap": 1.5}, batch)
    named, _, _ = _loss({"rollout_correction": "token_tis", "tis_cap": 1.5}, batch)
    assert legacy == named == pytest.approx(-4 / 3)
    assert m["actor/tis_weight_mean"] == m["actor/correction_weight_mean"] == pytest.approx(4 / 3)
    assert m["actor/correction_capped_fraction"] == pytest.approx(2 / 3)


def test_seq_tis_weighs_every_token_by_the_capped_sequence_ratio():
    # prod rho = 1 * 2 * 0.5 = 1 (under the default cap 2): the plain loss (-1 + 1 - 3) / 3.
    batch = _batch([0.0, LN2, -LN2], [1.0, -1.0, 3.0])
    loss, _, m = _loss({"rollout_correction": "seq_tis"}, batch)
    assert loss == pytest.approx(-1.0)
    assert m["actor/correction_capped_seq_fraction"] == 0.0


def test_no_correction_by_default():
    batch = _batch([0.0, LN2, 3 * LN2], [1.0, -1.0, 3.0])
    loss, _, m = _loss({}, batch)
    assert loss == pytest.approx(-1.0)
    assert not any(k.startswith("actor/correction_") or k == "actor/tis_weight_mean" for k in m)


def _advantage_batch(old_BT, rollout_BT):
    return {
        "scores": torch.tensor([1.0, 0.0]),
        "response_mask": torch.ones(2, 2),
        "old_logprobs": old_BT,
        "rollout_logprobs": rollout_BT,
    }


def test_every_step_reports_the_trainer_vs_rollout_k3_kl():
    # Log-ratios old - rollout: ln 2, -ln 2, 0, 0: k3 = (1 - ln 2) + (ln 2 - 0.5) = 0.5 over 4
    # tokens. Reused log-probs (old = rollout) measure 0.
    rollout_BT = torch.full((2, 2), -1.0)
    old_BT = rollout_BT + torch.tensor([[LN2, -LN2], [0.0, 0.0]])
    _, metrics = batch_advantages(AlgorithmConfig(), _advantage_batch(old_BT, rollout_BT), 2)
    assert metrics["rollout/mismatch_k3_kl"] == pytest.approx(0.125)
    assert metrics["rollout/mismatch_ratio_max"] == pytest.approx(2.0)
    reused = _advantage_batch(rollout_BT.clone(), rollout_BT)
    _, metrics = batch_advantages(AlgorithmConfig(), reused, 2)
    assert metrics["rollout/mismatch_k3_kl"] == 0.0
