import math

import pytest
import torch

from roll_ds.algorithms.kl import (
    KL_ESTIMATORS,
    entropy_bonus,
    entropy_from_logits,
    kl_k3,
    kl_loss,
    kl_penalty,
)

LN2 = math.log(2.0)
# Policy gives the sampled token p = 0.5, the reference 0.25: log-ratio = ln 2.
LOGP_BT = torch.tensor([[math.log(0.5)]])
REF_BT = torch.tensor([[math.log(0.25)]])


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", LN2),  # 0.693147
        ("k2", 0.5 * LN2**2),  # 0.240227
        ("k3", (0.5 - 1.0) - math.log(0.5)),  # r = exp(ref - logp) = 0.5 -> 0.193147
    ],
)
def test_estimator_values(estimator, expected):
    assert kl_penalty(LOGP_BT, REF_BT, estimator).item() == pytest.approx(expected, rel=1e-6)


def test_reverse_direction_values():
    # Swap roles: log-ratio = -ln 2; k1 = -0.693147, k2 = 0.240227, k3 = (2 - 1) - ln 2 = 0.306853.
    assert kl_penalty(REF_BT, LOGP_BT, "k1").item() == pytest.approx(-LN2)
    assert kl_penalty(REF_BT, LOGP_BT, "k2").item() == pytest.approx(0.5 * LN2**2)
    assert kl_penalty(REF_BT, LOGP_BT, "k3").item() == pytest.approx(1.0 - LN2)


def test_identical_policies_have_zero_kl():
    logp_BT = torch.log(torch.tensor([[0.1, 0.7, 0.2]]))
    for name in KL_ESTIMATORS.names():
        assert kl_penalty(logp_BT, logp_BT, name).abs().max().item() == 0.0


def test_clamp():
    assert kl_penalty(LOGP_BT, REF_BT, "k1", clamp=0.5).item() == pytest.approx(0.5)
    assert kl_penalty(REF_BT, LOGP_BT, "k1", clamp=0.5).item() == pytest.approx(-0.5)


def test_k3_finite_for_huge_log_ratio():
    got = kl_k3(torch.tensor([[-1000.0]]), torch.tensor([[0.0]]))
    assert torch.isfinite(got).all()


def test_kl_loss_aggregates_over_mask():
    logp_BT = torch.tensor([[math.log(0.5), 0.0], [math.log(0.5), 123.0]])
    ref_BT = torch.tensor([[math.log(0.25), 0.0], [math.log(0.5), -5.0]])
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    # k1 per valid token: ln2, 0, 0 -> token-mean ln2 / 3; seq-mean-token-mean (ln2/2 + 0) / 2.
    assert kl_loss(logp_BT, ref_BT, mask_BT, estimator="k1").item() == pytest.approx(LN2 / 3)
    got = kl_loss(logp_BT, ref_BT, mask_BT, estimator="k1", agg_mode="seq-mean-token-mean")
    assert got.item() == pytest.approx(LN2 / 4)


def test_unknown_estimator_lists_valid():
    with pytest.raises(ValueError, match=r"^unknown kl estimator 'k4'; valid: k1, k2, k3$"):
        kl_penalty(LOGP_BT, REF_BT, "k4")


def test_entropy_uniform_is_log_v():
    logits_BTV = torch.zeros(2, 3, 8)
    torch.testing.assert_close(entropy_from_logits(logits_BTV), torch.full((2, 3), math.log(8)))


def test_entropy_hand_computed():
    # p = [0.5, 0.25, 0.25]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.039721
    logits_BTV = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]])) + 3.0  # shift-invariant
    assert entropy_from_logits(logits_BTV).item() == pytest.approx(1.5 * LN2, rel=1e-6)


def test_entropy_numerically_stable():
    logits_BTV = torch.tensor([[[1000.0, 0.0, -1000.0], [0.0, 0.0, -math.inf]]])
    got = entropy_from_logits(logits_BTV)
    assert torch.isfinite(got).all()
    assert got[0, 0].item() == pytest.approx(0.0, abs=1e-6)
    assert got[0, 1].item() == pytest.approx(LN2)
    bf16 = entropy_from_logits(torch.zeros(1, 1, 4, dtype=torch.bfloat16))
    assert bf16.dtype == torch.float32 and bf16.item() == pytest.approx(math.log(4))


def test_entropy_bonus_is_negative_scaled_mean():
    entropy_BT = torch.tensor([[1.0, 3.0], [2.0, 50.0]])
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    assert entropy_bonus(entropy_BT, mask_BT, coef=0.01).item() == pytest.approx(-0.01 * 2.0)
