"""Per-turn returns and advantages against hand-computed values; episodes packed for training."""

from __future__ import annotations

import pytest
import torch

from roll_ds.agentic.episode import DONE, Episode
from roll_ds.algorithms.turns import discounted_turn_returns, per_turn_advantages
from roll_ds.config.agentic import EnvManagerConfig
from roll_ds.pipeline.packing import pack_episodes
from roll_ds.pipeline.tasks import env_specs, group_tags, train_seeds


def test_discounted_turn_returns_by_hand():
    assert discounted_turn_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_turn_returns([1.0, -1.0, 2.0], 1.0) == [2.0, 1.0, 2.0]
    assert discounted_turn_returns([], 0.9) == []


def test_per_turn_advantages_by_hand():
    # group of 2: episode returns G0 = 1 and 0 -> mean 0.5, unbiased std 0.7071
    turn_returns = torch.tensor([[0.5, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv = per_turn_advantages(turn_returns, torch.tensor([1.0, 0.0]), mask, group_size=2)
    std = (0.5**2 * 2) ** 0.5
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.5 / std], [-0.5 / std, -0.5 / std, -0.5 / std, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-5)
    # a group whose returns are all equal carries no signal
    same = per_turn_advantages(turn_returns, torch.tensor([1.0, 1.0]), mask, group_size=2)
    assert torch.equal(same, torch.zeros_like(same))


def _episode(eid, prompt, turns):
    ep = Episode(eid, 0, "guess", 9, prompt_ids=list(prompt))
    for policy, obs, reward in turns:
        ep.add_policy_turn(policy, [-0.1] * len(policy), closed=True)
        ep.add_reward(reward, {"success": reward > 0})
        ep.record("a", "o", reward)
        if obs:
            ep.add_observation(obs)
    ep.end(DONE)
    return ep


def test_pack_episodes_masks_policy_tokens_only():
    a = _episode(0, [1, 2], [([3, 4], [5, 6, 7], 0.0), ([8], [], 1.0)])
    b = _episode(1, [1, 2, 9], [([3], [], 0.0)])
    batch = pack_episodes([a, b], [], pad_id=0, gamma=0.5)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 3, 0, 0, 0, 0]]
    # shifted layout: column j scores token j+1
    assert batch["response_mask"].tolist() == [
        [0, 1, 1, 0, 0, 0, 1],
        [0, 0, 1, 0, 0, 0, 0],
    ]
    assert torch.equal(batch["loss_mask"], batch["response_mask"])
    lp = batch["rollout_logprobs"]
    assert lp[0].tolist() == pytest.approx([0, -0.1, -0.1, 0, 0, 0, -0.1])
    # turn 0's tokens get G_0 = 0 + 0.5 * 1, turn 1's G_1 = 1
    assert batch["turn_returns"][0].tolist() == pytest.approx([0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0])
    assert batch["scores"].tolist() == [1.0, 0.0]
    assert list(batch["status"]) == [DONE, DONE]


def test_groups_split_over_tags_and_seeds_stay_below_the_held_out_range():
    manager = EnvManagerConfig(num_env_groups=5, group_size=2, tags=["a", "b"])
    assert group_tags(manager) == ["a", "a", "a", "b", "b"]
    manager.num_groups_partition = [1, 4]
    assert group_tags(manager) == ["a", "b", "b", "b", "b"]
    seeds = train_seeds(42, 3, 5, 1000)
    assert seeds == train_seeds(42, 3, 5, 1000) and seeds != train_seeds(42, 4, 5, 1000)
    assert all(0 <= s < 1000 for s in seeds)
    specs = env_specs(manager, seed_of_group=seeds)
    assert [s.group for s in specs] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert specs[2].env_seed == specs[3].env_seed == seeds[1]
    assert [s.episode_id for s in specs] == list(range(10))
