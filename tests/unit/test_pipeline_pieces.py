import torch

from roll_ds.config.schema import AlgorithmConfig
from roll_ds.pipeline.losses import PolicyLoss
from roll_ds.pipeline.sequences import pack_sequences, scatter_response_values


def test_pack_sequences_aligns_response_mask_with_shifted_logprobs():
    out = pack_sequences([[5, 6], [7]], [[8, 9, 2], [3]], pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 8, 9, 2], [7, 3, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # column j scores token j+1: row 0 response tokens are at 2,3,4 -> columns 1,2,3
    assert out["response_mask"].tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]


def test_scatter_response_values_places_values_under_the_mask():
    values = scatter_response_values([[-0.1, -0.2, -0.3], [-0.5]], [2, 1], width=5)
    assert torch.allclose(
        values, torch.tensor([[0, -0.1, -0.2, -0.3], [-0.5, 0, 0, 0]], dtype=torch.float32)
    )


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    # On-policy (logprobs == old) the PPO ratio is 1: token-mean loss = -mean(A) over valid tokens.
    loss_fn = PolicyLoss.from_config(AlgorithmConfig(), response_length=4)
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 1, 1]])
    adv = torch.tensor([[0.0, 1, 1, 0], [-0.5, -0.5, -0.5, -0.5]])
    logp = torch.log(torch.full((2, 4), 0.5))
    batch = {"response_mask": mask, "old_logprobs": logp.clone(), "advantages": adv}
    loss, metrics = loss_fn(logp, batch)
    expected = -(1 + 1 - 0.5 * 4) / 6
    assert abs(loss.item() - expected) < 1e-6
    assert metrics["actor/clipfrac"] == 0.0
    assert abs(metrics["actor/ratio_mean"] - 1.0) < 1e-6


def test_policy_loss_adds_kl_and_entropy_terms():
    algo = AlgorithmConfig(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    loss_fn = PolicyLoss.from_config(algo, response_length=2)
    mask = torch.ones(1, 2)
    logp = torch.tensor([[-1.0, -2.0]])
    batch = {
        "response_mask": mask,
        "old_logprobs": logp.clone(),
        "advantages": torch.zeros(1, 2),
        "ref_logprobs": torch.tensor([[-1.5, -2.5]]),
    }
    entropy = torch.tensor([[0.7, 0.3]])
    loss, metrics = loss_fn(logp, batch, entropy)
    # pg 0; k1 = logp - ref = 0.5 per token -> 0.5 * 0.5; entropy mean 0.5 -> -0.1 * 0.5
    assert abs(loss.item() - (0.25 - 0.05)) < 1e-6
    assert abs(metrics["actor/kl_loss"] - 0.5) < 1e-6
    assert abs(metrics["actor/entropy"] - 0.5) < 1e-6


def test_domain_routes_require_every_domain_once():
    from roll_ds.pipeline.rollout import domain_routes

    assert domain_routes(["math", "reverse"], {"m": ["math"], "r": ["reverse"]}) == {
        "math": "m",
        "reverse": "r",
    }
    import pytest

    with pytest.raises(ValueError, match=r"no reward role scores the data domains \['reverse'\]"):
        domain_routes(["math", "reverse"], {"m": ["math"]})
    with pytest.raises(ValueError, match="domain 'math' is also in m"):
        domain_routes(["math"], {"m": ["math"], "m2": ["math"]})


def test_group_has_signal():
    from roll_ds.pipeline.rollout import group_has_signal

    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert group_has_signal(scores, 2).tolist() == [False, False, True]


def test_domain_metrics_by_hand():
    from roll_ds.pipeline.rollout import domain_metrics

    infos = [{"correct": True}, {"correct": False}, {"correct": True, "timed_out": True}, {}]
    out = domain_metrics("eval", ["a", "a", "b", "b"], [1.0, 0.0, 1.0, 0.5], infos)
    assert out["eval/score"] == 0.625
    assert out["eval/accuracy"] == 2 / 3  # rows without "correct" do not count
    assert out["eval/a/accuracy"] == 0.5
    assert out["eval/b/accuracy"] == 1.0
    assert out["eval/b/score"] == 0.75
    assert out["eval/timeouts"] == 1.0
