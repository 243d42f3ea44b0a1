import math

import pytest
import torch

from roll_ds.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    token_level_rewards,
)

SCORES_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # two prompts, G = 4
MASK_BT = torch.tensor([[1, 1, 0]] * 8)


def _run(name, scores_B=SCORES_B, mask_BT=MASK_BT, **kw):
    inputs = AdvantageInputs(scores_B=scores_B, response_mask_BT=mask_BT, **kw)
    return compute_advantages(name, inputs)


def test_grpo_hand_computed():
    # Group 1: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735
    #          -> +-0.5 / 0.57735 = +-0.866025.
    # Group 2: all equal -> 0.
    a = 0.5 / math.sqrt(1 / 3)
    got = grpo_advantages(SCORES_B, 4, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))


def test_grpo_broadcast_and_returns():
    adv_BT, ret_BT = _run("grpo", group_size=4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv_BT[:, 0].tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], rel=1e-6)
    torch.testing.assert_close(adv_BT[:, 1], adv_BT[:, 0])
    assert adv_BT[:, 2].abs().max().item() == 0.0  # padding
    # Returns: the score on every valid token (no KL, undiscounted reward-to-go).
    torch.testing.assert_close(ret_BT, SCORES_B[:, None] * MASK_BT)


def test_grpo_constant_group_is_exactly_zero():
    got = grpo_advantages(torch.tensor([0.1, 0.1, 0.1]), 3)
    assert got.abs().max().item() == 0.0
    assert grpo_advantages(torch.tensor([0.3, 0.7]), 1).tolist() == [0.0, 0.0]


def test_dr_grpo_hand_computed():
    adv_BT, _ = _run("dr_grpo", group_size=4)
    assert adv_BT[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_rloo_hand_computed():
    # r0 = 1 - (0 + 0 + 1)/3 = 2/3; r1 = 0 - (1 + 0 + 1)/3 = -2/3; group 2 -> 0.
    got = rloo_advantages(SCORES_B, 4)
    torch.testing.assert_close(got, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    # G = 2, rewards [3, 1]: 3 - 1 = 2, 1 - 3 = -2.
    assert rloo_advantages(torch.tensor([3.0, 1.0]), 2).tolist() == [2.0, -2.0]
    adv_BT, _ = _run("rloo", group_size=4)
    torch.testing.assert_close(adv_BT[:, 0], got)


def test_kl_in_reward_for_outcome_estimators():
    # Sequence reward = score - 0.5 * sum(kl over valid tokens): [1 - 0.5*0.4, 0 - 0.5*(0.2)] =
    # [0.8, -0.1] -> dr_grpo (G=2): +-0.45. Padding KL (7.0) must be ignored.
    scores_B = torch.tensor([1.0, 0.0])
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    kl_BT = torch.tensor([[0.1, 0.3], [0.2, 7.0]])
    adv_BT, ret_BT = _run("dr_grpo", scores_B, mask_BT, group_size=2, kl_BT=kl_BT, kl_coef=0.5)
    torch.testing.assert_close(adv_BT, torch.tensor([[0.45, 0.45], [-0.45, 0.0]]))
    # Reward-to-go of token rewards [[-0.05, -0.15 + 1], [-0.1 + 0, pad]].
    torch.testing.assert_close(ret_BT, torch.tensor([[0.8, 0.85], [-0.1, 0.0]]))


def test_token_level_rewards():
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    kl_BT = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0], [1.0, 1.0, 1.0]])
    got = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask_BT, kl_BT, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.25, 1.75, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(got, expected)
    no_kl = token_level_rewards(torch.tensor([1, 0, 1]), mask_BT)
    assert no_kl.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="needs kl_BT"):
        token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask_BT, kl_coef=0.1)


def test_discounted_returns():
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0], [1.0, 2.0, 5.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = discounted_returns(rewards_BT, mask_BT, gamma=0.5)
    # Row 0: [0.25, 0.5, 1]; row 1 (last token padded): [1 + 0.5*2, 2, 0].
    torch.testing.assert_close(got, torch.tensor([[0.25, 0.5, 1.0], [2.0, 2.0, 0.0]]))
    ones = discounted_returns(rewards_BT, mask_BT, gamma=1.0)
    torch.testing.assert_close(ones, torch.tensor([[1.0, 1.0, 1.0], [3.0, 2.0, 0.0]]))


def test_reinforce_plus_plus_hand_computed():
    # Token rewards (kl_coef 0.5): row 0 [-0.05, -0.1, 0.85], row 1 [-0.25, -0.25, pad].
    # Returns (gamma 1): [0.7, 0.75, 0.85] and [-0.5, -0.25].
    # Whiten over 5 tokens: mean 1.55/5 = 0.31; squared deviations sum 1.607; unbiased var 0.40175.
    scores_B = torch.tensor([1.0, 0.0])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl_BT = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    adv_BT, ret_BT = _run("reinforce_plus_plus", scores_B, mask_BT, kl_BT=kl_BT, kl_coef=0.5)
    torch.testing.assert_close(ret_BT, torch.tensor([[0.7, 0.75, 0.85], [-0.5, -0.25, 0.0]]))
    std = math.sqrt(1.607 / 4 + 1e-8)
    expected = torch.tensor([[0.39, 0.44, 0.54], [-0.81, -0.56, 0.0]]) / std
    expected[1, 2] = 0.0
    torch.testing.assert_close(adv_BT, expected)


def test_reinforce_plus_plus_gamma():
    # One row, score 1 at the last of 3 tokens, gamma 0.5: returns [0.25, 0.5, 1.0].
    _, ret_BT = _run("reinforce_plus_plus", torch.tensor([1.0]), torch.ones(1, 3), gamma=0.5)
    torch.testing.assert_close(ret_BT, torch.tensor([[0.25, 0.5, 1.0]]))


def test_reinforce_plus_plus_baseline_hand_computed():
    # Scores [1, 0 | 1, 1], G = 2 -> baselined [0.5, -0.5, 0, 0]; returns constant per row (T=2).
    # Whiten over 8 tokens: mean 0, unbiased var (4 * 0.25) / 7 = 1/7 -> +-0.5 * sqrt(7).
    adv_BT, ret_BT = _run(
        "reinforce_plus_plus_baseline",
        torch.tensor([1.0, 0.0, 1.0, 1.0]),
        torch.ones(4, 2),
        group_size=2,
    )
    torch.testing.assert_close(
        ret_BT, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]])
    )
    a = 0.5 * math.sqrt(7)
    torch.testing.assert_close(
        adv_BT, torch.tensor([[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]]), rtol=1e-6, atol=1e-6
    )


def test_gae_three_tokens_by_hand():
    # gamma = lam = 0.5, rewards [0, 0, 1], values [0.5, 0.25, 0.5]:
    # t=2: delta = 1 + 0 - 0.5 = 0.5                  A2 = 0.5
    # t=1: delta = 0 + 0.5*0.5 - 0.25 = 0              A1 = 0 + 0.25*0.5 = 0.125
    # t=0: delta = 0 + 0.5*0.25 - 0.5 = -0.375         A0 = -0.375 + 0.25*0.125 = -0.34375
    # returns = A + V = [0.15625, 0.375, 1.0]
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values_BT = torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.25, 123.0]])  # row 1 padded at t=2
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv_BT, ret_BT = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=0.5, lam=0.5)
    # Row 1 (2 tokens): t=1: delta = 1 - 0.25 = 0.75 = A1; t=0: delta = 0.125 - 0.5 = -0.375,
    # A0 = -0.375 + 0.25*0.75 = -0.1875; returns [0.3125, 1.0].
    torch.testing.assert_close(adv_BT, torch.tensor([[-0.34375, 0.125, 0.5], [-0.1875, 0.75, 0.0]]))
    torch.testing.assert_close(ret_BT, torch.tensor([[0.15625, 0.375, 1.0], [0.3125, 1.0, 0.0]]))


def test_gae_whiten_and_registry_path():
    values_BT = torch.tensor([[0.5, 0.25, 0.5]])
    adv_BT, ret_BT = _run(
        "gae",
        torch.tensor([1.0]),
        torch.ones(1, 3),
        values_BT=values_BT,
        gamma=0.5,
        lam=0.5,
        whiten_advantages=True,
    )
    torch.testing.assert_close(ret_BT, torch.tensor([[0.15625, 0.375, 1.0]]))
    raw = torch.tensor([-0.34375, 0.125, 0.5])
    expected = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)
    torch.testing.assert_close(adv_BT[0], expected)


def test_gae_gamma_lam_one_equals_return_minus_value():
    rewards_BT = torch.tensor([[0.0, 0.0, 2.0]])
    values_BT = torch.tensor([[0.5, 1.0, 1.5]])
    adv_BT, _ = gae_advantages(rewards_BT, values_BT, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv_BT, torch.tensor([[1.5, 1.0, 0.5]]))


def test_group_divisibility_error():
    with pytest.raises(ValueError, match=r"batch of 6 rollouts is not divisible by group size 4"):
        _run("grpo", SCORES_B[:6], MASK_BT[:6], group_size=4)
    with pytest.raises(ValueError, match="not divisible"):
        rloo_advantages(SCORES_B[:6], 4)


def test_rloo_needs_two_per_group():
    with pytest.raises(ValueError, match="rloo needs group size >= 2"):
        rloo_advantages(SCORES_B, 1)


def test_unknown_estimator_lists_valid():
    with pytest.raises(ValueError) as err:
        _run("ppo")
    assert str(err.value) == (
        "unknown advantage estimator 'ppo'; valid: dr_grpo, gae, grpo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, rloo"
    )
    assert len(ADVANTAGE_ESTIMATORS) == 6


def test_options_without_effect_are_rejected():
    with pytest.raises(
        ValueError,
        match=r"lam=0\.95 has no effect with advantage estimator 'grpo'",
    ):
        _run("grpo", group_size=4, lam=0.95)
    with pytest.raises(ValueError, match="'rloo' does not use critic values"):
        _run("rloo", group_size=4, values_BT=torch.zeros(8, 3))
    with pytest.raises(ValueError, match="needs critic values"):
        _run("gae")
    with pytest.raises(ValueError, match="needs kl_BT"):
        _run("grpo", group_size=4, kl_coef=0.1)


def test_whiten_advantages_applies_to_every_estimator():
    # grpo, group 1 of SCORES_B: advantages +-a on 2 valid tokens per row, group 2: 0.
    # Over the 16 valid tokens: mean 0, unbiased var = 8 a^2 / 15 -> whitened +-a / sqrt(var).
    raw_BT, ret_BT = _run("grpo", group_size=4)
    adv_BT, whitened_ret_BT = _run("grpo", group_size=4, whiten_advantages=True)
    a = raw_BT[0, 0].item()
    scale = 1 / math.sqrt(8 * a * a / 15 + 1e-8)
    expected = [s * scale for s in raw_BT[:, 0].tolist()]
    assert adv_BT[:, 0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert adv_BT[:, 2].abs().max().item() == 0.0  # padding stays 0
    torch.testing.assert_close(whitened_ret_BT, ret_BT)  # returns are never whitened
    # dr_grpo: [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0] -> the same pattern at the same scale.
    dr_BT, _ = _run("dr_grpo", group_size=4, whiten_advantages=True)
    torch.testing.assert_close(dr_BT, adv_BT, rtol=1e-5, atol=1e-6)


def test_whiten_advantages_on_a_shifted_batch():
    # rloo, G = 2, rewards [3, 1] and [1, 1], one token each: raw [2, -2, 0, 0], mean 0,
    # unbiased var 8/3 -> [2, -2, 0, 0] / sqrt(8/3).
    adv_BT, _ = _run(
        "rloo",
        torch.tensor([3.0, 1.0, 1.0, 1.0]),
        torch.ones(4, 1),
        group_size=2,
        whiten_advantages=True,
    )
    expected = torch.tensor([2.0, -2.0, 0.0, 0.0]) / math.sqrt(8 / 3 + 1e-8)
    torch.testing.assert_close(adv_BT[:, 0], expected)


def test_reinforce_plus_plus_is_already_whitened():
    plain, _ = _run("reinforce_plus_plus", gamma=0.5)
    again, _ = _run("reinforce_plus_plus", gamma=0.5, whiten_advantages=True)
    assert torch.equal(plain, again)


def test_registry_options_come_from_the_config_table():
    from roll_ds.config.estimators import ESTIMATOR_OPTIONS, estimators_using, needs_critic

    assert set(ADVANTAGE_ESTIMATORS.names()) == set(ESTIMATOR_OPTIONS)
    for name in ESTIMATOR_OPTIONS:
        assert ADVANTAGE_ESTIMATORS.get(name).options == ESTIMATOR_OPTIONS[name]
    assert estimators_using("lam") == ["gae"]
    assert estimators_using("gamma") == [
        "gae",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
    ]
    assert needs_critic("gae") and not needs_critic("grpo") and not needs_critic("nope")
