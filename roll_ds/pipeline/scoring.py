"""The scores of dataset rows' episodes: each domain's responses go to its reward role in one
batch (rule functions, a reward model, a judge, the code sandbox), all roles at once.

Environment episodes need nothing here: their environment rewarded every turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from roll_ds.agentic.episode import Episode
from roll_ds.algorithms.masks import overlong_soft_penalty
from roll_ds.config.schema import AlgorithmConfig
from roll_ds.distributed.batch import Batch


def response_texts(episodes: Sequence[Episode], tokenizer: Any) -> list[str]:
    """Each row episode's response as the reward sees it (special tokens dropped)."""
    return [tokenizer.decode(e.token_ids, skip_special_tokens=True) for e in episodes]


def score_rows(
    episodes: Sequence[Episode],
    rows: Sequence[Mapping[str, Any]],
    clusters: Mapping[str, Any],
    routes: Mapping[str, str],
    tokenizer: Any,
) -> torch.Tensor:
    """Score the row episodes (``episode.row`` indexes ``rows``) by their domain's reward role:
    each episode's reward is set and its ``info`` holds the reward's (``correct``, ...).
    Returns the scores ``[B]`` (float32, as the roles gave them)."""
    scores = torch.zeros(len(episodes))
    infos: list[dict] = [{} for _ in episodes]
    texts = response_texts(episodes, tokenizer)
    domains = [e.tag for e in episodes]
    calls = []
    for role in sorted({routes[d] for d in domains}):
        mine = [i for i, d in enumerate(domains) if routes[d] == role]
        part = Batch(
            non_tensors={
                "prompt": [rows[episodes[i].row]["prompt"] for i in mine],
                "ground_truth": [rows[episodes[i].row]["ground_truth"] for i in mine],
                "response_text": [texts[i] for i in mine],
            }
        )
        calls.append((mine, clusters[f"rewards.{role}"].submit("score", part)))
    for mine, call in calls:
        out = call.get()
        scores[mine] = torch.tensor([float(x) for x in out["scores"]], dtype=scores.dtype)
        for i, info in zip(mine, out["reward_info"], strict=True):
            infos[i] = info
    for episode, score, info, text in zip(episodes, scores.tolist(), infos, texts, strict=True):
        episode.turn_rewards[-1] = score
        episode.info = dict(info)
        episode.turns = [{"action": text, "observation": "", "reward": score}]
    return scores


def apply_overlong_penalty(
    episodes: Sequence[Episode], scores_B: torch.Tensor, algo: AlgorithmConfig, limit: int
) -> torch.Tensor | None:
    """DAPO's soft overlong punishment (``algorithm.overlong_buffer_len`` > 0) added to the row
    episodes' rewards before advantages and dynamic sampling see them; returns the penalty
    ``[B]`` (None: off)."""
    if not algo.overlong_buffer_len:
        return None
    lengths_B = torch.tensor([len(e.token_ids) for e in episodes])
    penalty_B = overlong_soft_penalty(
        lengths_B, limit, algo.overlong_buffer_len, algo.overlong_penalty_factor
    )
    for episode, score in zip(episodes, (scores_B + penalty_B).tolist(), strict=True):
        episode.turn_rewards[-1] = score
    return penalty_B


def group_has_signal(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[num_groups]`` bool: the group's rewards are not all equal (it carries a gradient)."""
    groups = scores_B.view(-1, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > 1e-6


def fit_groups(kept: list[list[Any]], spare: list[list[Any]], want: int) -> tuple[list[Any], int]:
    """Dynamic sampling's ``want`` groups: the first ``want`` kept groups (those with signal),
    or all of them followed by groups without signal from ``spare`` (never a kept group twice);
    returns the groups' episodes, flat, and how many of the groups are such padding. Enough
    spare groups always exist: every round draws ``want`` groups, each kept or spare."""
    padding = max(0, want - len(kept))
    if len(spare) < padding:
        raise RuntimeError(f"dynamic sampling: {len(spare)} spare groups for {padding} padding")
    chosen = kept[:want] + spare[:padding]
    return [e for group in chosen for e in group], padding
