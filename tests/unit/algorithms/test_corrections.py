"""Rollout corrections against hand-computed weights, masks and metrics.

The batch: ratios rho = pi_old / pi_rollout of [2, 1, 0.25] (row 0) and [8, 0.5, padding]
(row 1); five valid tokens. Padding holds NaN, which must never leak into a result.
"""

import math

import pytest
import torch

from roll_ds.algorithms.corrections import (
    CORRECTIONS,
    CorrectionParams,
    rollout_correction,
)
from roll_ds.algorithms.policy_loss import tis_weights

LN2 = math.log(2)
NAN = math.nan


def _batch(log_ratios, mask):
    """(old_BT, rollout_BT, mask_BT) with old - rollout = ``log_ratios`` (NaN where masked)."""
    mask_BT = torch.tensor(mask, dtype=torch.bool)
    old_BT = torch.full(mask_BT.shape, -1.0, dtype=torch.float64)
    rollout_BT = old_BT - torch.tensor(log_ratios, dtype=torch.float64)
    return old_BT.requires_grad_(), torch.where(mask_BT, rollout_BT, NAN), mask_BT


BATCH = ([[LN2, 0.0, -2 * LN2], [3 * LN2, -LN2, NAN]], [[1, 1, 1], [1, 1, 0]])


def _run(name, batch=BATCH, **params):
    out = rollout_correction(name, *_batch(*batch), CorrectionParams(**params))
    return out.weights_BT, out.keep_BT, {k: v.item() for k, v in out.metrics.items()}


def test_registry_lists_the_corrections():
    assert CORRECTIONS.names() == ["geo_mask", "icepop", "seq_tis", "token_tis"]
    with pytest.raises(ValueError, match="unknown rollout correction 'tis'; valid: geo_mask"):
        _run("tis")


def test_token_tis_caps_each_token():
    # min(rho, 1.5): [1.5, 1, 0.25], [1.5, 0.5, 0]; mean 4.75 / 5; 2 of 5 tokens capped.
    weights, keep, m = _run("token_tis", cap=1.5)
    torch.testing.assert_close(
        weights, torch.tensor([[1.5, 1.0, 0.25], [1.5, 0.5, 0.0]], dtype=torch.float64)
    )
    assert keep is None and not weights.requires_grad
    assert m == pytest.approx({"weight_mean": 0.95, "capped_fraction": 0.4})


def test_token_tis_is_todays_tis_exactly():
    old_BT, rollout_BT, mask_BT = _batch(*BATCH)
    weights, _, _ = _run("token_tis", cap=1.5)
    assert torch.equal(weights, tis_weights(old_BT, rollout_BT, 1.5, mask_BT))


def test_token_tis_default_cap_is_2():
    weights, _, _ = _run("token_tis")
    assert weights[1, 0].item() == 2.0 and weights[0, 0].item() == pytest.approx(2.0)


def test_seq_tis_caps_the_product_of_ratios_per_sequence():
    # Row 0: 2 * 1 * 0.25 = 0.5; row 1: 8 * 0.5 = 4 -> cap 3. Token mean (3 * 0.5 + 2 * 3) / 5;
    # row 1's 2 tokens (1 of 2 sequences) capped.
    weights, keep, m = _run("seq_tis", cap=3.0)
    torch.testing.assert_close(
        weights, torch.tensor([[0.5, 0.5, 0.5], [3.0, 3.0, 0.0]], dtype=torch.float64)
    )
    assert keep is None
    assert m == pytest.approx(
        {"weight_mean": 1.5, "capped_fraction": 0.4, "capped_seq_fraction": 0.5}
    )
    uncapped, _, _ = _run("seq_tis", cap=10.0)
    assert uncapped[1, :2].tolist() == pytest.approx([4.0, 4.0])


def test_icepop_masks_tokens_outside_the_bounds_and_keeps_the_ratio_inside():
    # [0.4, 5]: 2 and 1 kept (weights = ratios), 0.25 and 8 masked, 0.5 kept.
    weights, keep, m = _run("icepop", low=0.4, high=5.0)
    torch.testing.assert_close(
        weights, torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.5, 0.0]], dtype=torch.float64)
    )
    assert keep.tolist() == [[True, True, False], [False, True, False]]
    assert m == pytest.approx({"weight_mean": 0.7, "masked_fraction": 0.4})


def test_icepop_default_bounds_are_ring_1t_half_and_five():
    ratios = [0.45, 0.55, 4.5, 5.5]
    _, keep, m = _run("icepop", batch=([[math.log(r) for r in ratios]], [[1, 1, 1, 1]]))
    assert keep.tolist() == [[False, True, True, False]]
    assert m["masked_fraction"] == pytest.approx(0.5)


def test_geo_mask_masks_sequences_by_their_geometric_mean_ratio():
    # Geometric means: row 0 (2 * 1 * 0.25)^(1/3) = 0.794, row 1 (8 * 0.5)^(1/2) = 2; row 2 has
    # no valid token (left out of the sequence fraction). [0.7, 1.5]: row 0 kept, row 1 masked.
    batch = (BATCH[0] + [[NAN, NAN, NAN]], BATCH[1] + [[0, 0, 0]])
    weights, keep, m = _run("geo_mask", batch=batch, low=0.7, high=1.5)
    torch.testing.assert_close(
        weights,
        torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64),
    )
    assert keep.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    assert m == pytest.approx(
        {"weight_mean": 0.6, "masked_fraction": 0.4, "masked_seq_fraction": 0.5}
    )


def test_geo_mask_default_bounds_keep_only_sequences_within_1e_3():
    # Row 0: ratios 2 and 0.5, geometric mean exactly 1 -> kept; row 1: exp(0.002 / 2) = 1.001005
    # -> masked; row 2: exp(0.0018 / 2) = 1.0009 -> kept.
    batch = ([[LN2, -LN2], [0.002, 0.0], [0.0018, 0.0]], [[1, 1]] * 3)
    _, keep, m = _run("geo_mask", batch=batch)
    assert keep.tolist() == [[True, True], [False, False], [True, True]]
    assert m["masked_seq_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", ["token_tis", "seq_tis", "icepop", "geo_mask"])
def test_on_policy_rollout_weighs_one_everywhere(name):
    weights, _, m = _run(name, batch=([[0.0, 0.0], [0.0, NAN]], [[1, 1], [1, 0]]))
    assert weights.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert m["weight_mean"] == 1.0
    assert m.get("masked_fraction", 0.0) == 0.0 and m.get("capped_fraction", 0.0) == 0.0


def test_invalid_params():
    with pytest.raises(ValueError, match="cap must be > 0"):
        _run("seq_tis", cap=0.0)
    with pytest.raises(ValueError, match=r"0 < low < 1 < high, got 1\.2, 5\.0"):
        _run("icepop", low=1.2)
    with pytest.raises(ValueError, match=r"0 < low < 1 < high, got 0\.999, 0\.9"):
        _run("geo_mask", high=0.9)
