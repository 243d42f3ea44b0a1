"""Per-turn rewards of multi-turn episodes: discounted returns and their group advantages.

An episode of turns ``0..K-1`` with rewards ``r_0..r_{K-1}`` has the return from turn ``t``

    G_t = r_t + gamma * r_{t+1} + ... + gamma^(K-1-t) * r_{K-1}

``per_turn_advantages`` gives every policy token of turn ``t`` the advantage
``(G_t - mean_g G_0) / (std_g G_0 + eps)``: the turn's return against its GRPO group's episode
returns (the same baseline and scale as trajectory-level GRPO, which it equals when only the
last turn is rewarded and ``gamma = 1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def discounted_turn_returns(turn_rewards: Sequence[float], gamma: float) -> list[float]:
    """``[G_0, ..., G_{K-1}]`` for one episode's per-turn rewards."""
    returns, running = [0.0] * len(turn_rewards), 0.0
    for t in range(len(turn_rewards) - 1, -1, -1):
        running = float(turn_rewards[t]) + gamma * running
        returns[t] = running
    return returns


def per_turn_advantages(
    turn_returns_BT: Tensor,
    episode_returns_B: Tensor,
    response_mask_BT: Tensor,
    group_size: int,
    eps: float = 1e-6,
) -> Tensor:
    """``[B, T]`` advantages: each token's turn return, centred and scaled by its group's
    episode returns (unbiased std); 0 off the mask and in groups whose returns are all equal."""
    if episode_returns_B.shape[0] % group_size:
        raise ValueError(
            f"{episode_returns_B.shape[0]} episodes do not split into groups of {group_size}"
        )
    returns_NG = episode_returns_B.float().reshape(-1, group_size)
    mean_B = returns_NG.mean(-1).repeat_interleave(group_size)
    if group_size > 1:
        std_B = returns_NG.std(-1).repeat_interleave(group_size)
    else:
        std_B = torch.ones_like(mean_B)
    constant_B = (returns_NG.amax(-1) == returns_NG.amin(-1)).repeat_interleave(group_size)
    adv_BT = (turn_returns_BT.float() - mean_B[:, None]) / (std_B[:, None] + eps)
    keep_BT = response_mask_BT.bool() & ~constant_B[:, None]
    return torch.where(keep_BT, adv_BT, 0.0)
