import math

import pytest
import torch

from roll_ds.algorithms.policy_loss import ppo_policy_loss, rollout_mismatch_metrics, tis_weights
from roll_ds.algorithms.value_loss import value_loss


def _logprobs(ratios, old=-1.0):
    """(logprobs_BT leaf with grad, old_logprobs_BT) giving the requested per-token ratios."""
    ratios_BT = torch.tensor(ratios, dtype=torch.float64)
    old_BT = torch.full_like(ratios_BT, old)
    return (old_BT + ratios_BT.log()).requires_grad_(True), old_BT


def _loss(ratios, advantages, mask=None, **kw):
    logp_BT, old_BT = _logprobs(ratios)
    adv_BT = torch.tensor(advantages, dtype=torch.float64)
    mask_BT = torch.ones_like(adv_BT) if mask is None else torch.tensor(mask)
    loss, metrics = ppo_policy_loss(logp_BT, old_BT, adv_BT, mask_BT, **kw)
    loss.backward()
    return loss.item(), logp_BT.grad, {k: v.item() for k, v in metrics.items()}


def test_positive_advantage_above_clip_takes_clipped_branch():
    # A = 1, r = 1.5 > 1.2: loss = -A * 1.2, no gradient.
    loss, grad, m = _loss([[1.5]], [[1.0]])
    assert loss == pytest.approx(-1.2)
    assert grad.item() == 0.0
    assert (m["clipfrac_high"], m["clipfrac_low"], m["clipfrac"]) == (1.0, 0.0, 1.0)


def test_negative_advantage_below_clip_takes_clipped_branch():
    # A = -1, r = 0.5 < 0.8: max(0.5, 0.8) = 0.8, no gradient.
    loss, grad, m = _loss([[0.5]], [[-1.0]])
    assert loss == pytest.approx(0.8)
    assert grad.item() == 0.0
    assert (m["clipfrac_low"], m["clipfrac_high"]) == (1.0, 0.0)


def test_unclipped_gradient_is_minus_advantage_times_ratio():
    # A = 2, r = 1.1 inside [0.8, 1.2]: loss = -2.2, d loss / d logp = -A * r = -2.2.
    loss, grad, m = _loss([[1.1]], [[2.0]])
    assert loss == pytest.approx(-2.2)
    assert grad.item() == pytest.approx(-2.2)
    assert m["clipfrac"] == 0.0


def test_batch_token_mean_and_metrics():
    # (A, r): (1, 1.5) -> -1.2 clipped high; (-1, 0.5) -> 0.8 clipped low; (2, 1.1) -> -2.2;
    # (-1, 1.5) -> max(1.5, 1.2) = 1.5 (pessimistic branch is the unclipped one); padding ignored.
    loss, _, m = _loss(
        [[1.5, 0.5, 1.1], [1.5, 7.0, 7.0]],
        [[1.0, -1.0, 2.0], [-1.0, 5.0, 5.0]],
        mask=[[1, 1, 1], [1, 0, 0]],
    )
    assert loss == pytest.approx((-1.2 + 0.8 - 2.2 + 1.5) / 4)
    assert (m["clipfrac_low"], m["clipfrac_high"], m["clipfrac"]) == (0.25, 0.25, 0.5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5) / 4)
    assert m["ratio_max"] == pytest.approx(1.5)
    # k3 per token, (r - 1) - ln r: 0.094535, 0.193147, 0.004690, 0.094535.
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5, 1.1, 1.5)]
    assert m["approx_kl"] == pytest.approx(sum(k3) / 4)
    assert m["dual_clipfrac"] == 0.0


def test_clip_higher_is_asymmetric():
    # clip_high 0.28: r = 1.25 stays unclipped (-1.25), r = 1.3 clips to -1.28.
    assert _loss([[1.25]], [[1.0]], clip_high=0.28)[0] == pytest.approx(-1.25)
    assert _loss([[1.3]], [[1.0]], clip_high=0.28)[0] == pytest.approx(-1.28)
    # The low side still clips at 0.8: A = -1, r = 0.75 -> 0.8.
    assert _loss([[0.75]], [[-1.0]], clip_high=0.28)[0] == pytest.approx(0.8)


def test_dual_clip_bounds_negative_advantages():
    # A = -1, r = 5: PPO gives max(5, 1.2) = 5; dual clip c = 3 caps it at 3, no gradient.
    assert _loss([[5.0]], [[-1.0]])[0] == pytest.approx(5.0)
    loss, grad, m = _loss([[5.0]], [[-1.0]], dual_clip=3.0)
    assert loss == pytest.approx(3.0)
    assert grad.item() == 0.0
    assert m["dual_clipfrac"] == 1.0
    # r = 2 < c: unchanged (2); positive advantages are never dual-clipped (-1.2).
    assert _loss([[2.0]], [[-1.0]], dual_clip=3.0)[0] == pytest.approx(2.0)
    assert _loss([[5.0]], [[1.0]], dual_clip=3.0)[0] == pytest.approx(-1.2)


def test_gspo_sequence_ratio():
    # Row 0 log-ratios [0.1, 0.3] -> s0 = exp(0.2) = 1.221403, A = 1, clipped to 1.1 -> -1.1.
    # Row 1 log-ratio [-0.2] (+ padding) -> s1 = exp(-0.2) = 0.818731, A = 1: unclipped -0.818731.
    old_BT = torch.tensor([[-1.0, -2.0], [-1.5, -1.0]], dtype=torch.float64)
    logp_BT = (
        old_BT + torch.tensor([[0.1, 0.3], [-0.2, 4.0]], dtype=torch.float64)
    ).requires_grad_()
    adv_BT = torch.ones(2, 2, dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    kw = dict(ratio_level="sequence", seq_clip_low=0.1, seq_clip_high=0.1)
    s1 = math.exp(-0.2)
    loss, m = ppo_policy_loss(
        logp_BT, old_BT, adv_BT, mask_BT, agg_mode="seq-mean-token-mean", **kw
    )
    assert loss.item() == pytest.approx((-1.1 - s1) / 2)
    assert m["clipfrac_high"].item() == pytest.approx(2 / 3)  # both tokens of row 0
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.2))
    token_mean, _ = ppo_policy_loss(logp_BT, old_BT, adv_BT, mask_BT, **kw)
    assert token_mean.item() == pytest.approx((-1.1 * 2 - s1) / 3)

    # Gradient equals GSPO's sequence objective -1/G sum_i min(s_i A_i, clip(s_i) A_i).
    loss.backward()
    ours = logp_BT.grad.clone()
    logp_BT.grad = None
    s_B = torch.exp(((logp_BT - old_BT) * mask_BT).sum(-1) / mask_BT.sum(-1))
    reference = -torch.minimum(s_B, s_B.clamp(0.9, 1.1)).mean()
    reference.backward()
    torch.testing.assert_close(ours, logp_BT.grad)
    assert ours[1, 0].item() == pytest.approx(-s1 / 2)


def test_gspo_uses_its_own_clip_range():
    # Default seq range (3e-4, 4e-4): exp(0.2) clips to 1.0004 even though clip_high = 0.2.
    loss, _, m = _loss([[math.exp(0.2)]], [[1.0]], ratio_level="sequence")
    assert loss == pytest.approx(-1.0004)
    assert m["clipfrac_high"] == 1.0


def test_importance_weights_scale_the_loss():
    loss, grad, _ = _loss([[1.0, 1.0]], [[1.0, 1.0]], is_weights_BT=torch.tensor([[0.5, 1.5]]))
    assert loss == pytest.approx((-0.5 - 1.5) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.75]], dtype=torch.float64))


def test_invalid_options():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        _loss([[1.0]], [[1.0]], dual_clip=1.0)
    with pytest.raises(ValueError, match="unknown ratio_level 'seq'; valid: token, sequence"):
        _loss([[1.0]], [[1.0]], ratio_level="seq")
    with pytest.raises(ValueError, match="clip_low"):
        _loss([[1.0]], [[1.0]], clip_low=1.0)


def test_empty_mask_gives_zero_loss_and_metrics():
    loss, _, m = _loss([[1.5]], [[1.0]], mask=[[0]])
    assert loss == 0.0
    assert all(v == 0.0 for v in m.values())


def test_tis_weights():
    # pi_old / pi_rollout = 0.5/0.25, 0.5/0.5, 0.5/1.0 = 2, 1, 0.5; cap 1.5.
    old_BT = torch.log(torch.tensor([[0.5, 0.5, 0.5]])).requires_grad_()
    rollout_BT = torch.log(torch.tensor([[0.25, 0.5, 1.0]]))
    got = tis_weights(old_BT, rollout_BT, cap=1.5)
    torch.testing.assert_close(got, torch.tensor([[1.5, 1.0, 0.5]]))
    assert not got.requires_grad
    masked = tis_weights(old_BT, rollout_BT, cap=1.5, response_mask_BT=torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(masked, torch.tensor([[1.5, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="TIS cap"):
        tis_weights(old_BT, rollout_BT, cap=0.0)


def test_rollout_mismatch_metrics():
    # Log-ratios ln 2 and -ln 2 (+ a padded garbage token): |d| mean ln 2; k3 (1 - ln 2) and
    # (ln 2 - 0.5) average to exactly 0.25; max ratio 2.
    old_BT = torch.log(torch.tensor([[0.5, 0.5, 1e-30]]))
    rollout_BT = torch.log(torch.tensor([[0.25, 1.0, 1.0]]))
    m = rollout_mismatch_metrics(old_BT, rollout_BT, torch.tensor([[1, 1, 0]]))
    assert m["mismatch_abs_logprob_diff"].item() == pytest.approx(math.log(2))
    assert m["mismatch_k3_kl"].item() == pytest.approx(0.25)
    assert m["mismatch_ratio_max"].item() == pytest.approx(2.0)


def test_value_loss_clipped():
    # Token 0: v 1.5, old 1.0, R 2.0 -> v_clip 1.2; max(0.25, 0.64) = 0.64 (clipped branch).
    # Token 1: v 0.9, old 1.0, R 0.5 -> inside the range; 0.16.  Loss 0.5 * mean = 0.2.
    values_BT = torch.tensor([[1.5, 0.9, 9.0]], requires_grad=True)
    old_BT = torch.tensor([[1.0, 1.0, 0.0]])
    returns_BT = torch.tensor([[2.0, 0.5, 0.0]])
    mask_BT = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(values_BT, old_BT, returns_BT, mask_BT, clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.16) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    assert m["vpred_mean"].item() == pytest.approx(1.2)
    loss.backward()
    # Clipped token: no gradient; unclipped: 0.5 * 2 * (0.9 - 0.5) / 2 = 0.2.
    torch.testing.assert_close(values_BT.grad, torch.tensor([[0.0, 0.2, 0.0]]))
    unclipped, _ = value_loss(values_BT, old_BT, returns_BT, mask_BT, clip_range=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 0.16) / 2)
