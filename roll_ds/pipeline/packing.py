"""Episodes -> the trainer's batch, and the ``rollout/*`` metrics of a step's episodes.

Row ``i`` of the batch is episode ``i``'s first observation then every token after it, policy
and observation alike (``sequences.pack_sequences``). ``response_mask`` is the policy mask (the
loss, KL, entropy, advantages and log-prob metrics cover the policy's tokens only); the
rollout's log-probs sit on the policy tokens; ``scores`` is each episode's return;
``turn_returns`` (environment episodes present) each policy token's discounted return from its
turn. ``loss_mask`` is the actor's: the response mask, less truncated rows under
``algorithm.mask_truncated`` and the dynamic-sampling padding groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roll_ds.agentic.episode import Episode
from roll_ds.agentic.runner import episode_metrics
from roll_ds.algorithms.turns import discounted_turn_returns
from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.rollout import domain_metrics
from roll_ds.pipeline.sequences import pack_sequences, scatter_response_values


def pack_episodes(
    episodes: Sequence[Episode],
    rows: Sequence[dict],
    pad_id: int,
    *,
    gamma: float = 1.0,
    mask_truncated: bool = False,
    padding: int = 0,
) -> Batch:
    """The training batch of ``episodes`` (a row episode's id is its row's, in ``rows``);
    ``gamma`` discounts turn returns; the last ``padding`` rows stay out of the actor's loss."""
    tensors = pack_sequences(
        [e.prompt_ids for e in episodes], [e.token_ids for e in episodes], pad_id
    )
    width = tensors["input_ids"].shape[1]
    prompt_lengths = [len(e.prompt_ids) for e in episodes]
    tensors["response_mask"] = scatter_response_values(
        [e.policy_mask for e in episodes], prompt_lengths, width
    )
    tensors["rollout_logprobs"] = scatter_response_values(
        [e.logprobs for e in episodes], prompt_lengths, width
    )
    tensors["loss_mask"] = tensors["response_mask"].clone()
    if mask_truncated:
        truncated = torch.tensor([e.is_row and e.finish_reason == "length" for e in episodes])
        tensors["loss_mask"][truncated] = 0.0
    if padding:  # dynamic sampling's padding groups carry no signal
        tensors["loss_mask"][len(episodes) - padding :] = 0.0
    tensors["scores"] = torch.tensor([e.total_reward for e in episodes], dtype=torch.float32)
    non_tensors: dict[str, list] = {
        "domain": [e.tag for e in episodes],
        "id": [rows[e.row]["id"] if e.is_row else _env_id(e) for e in episodes],
        "response_text": [" | ".join(t["action"] for t in e.turns) for e in episodes],
        # the first observation: a row's prompt, an environment's reset observation
        "prompt_text": [
            rows[e.row].get("prompt") if e.is_row else e.first_observation for e in episodes
        ],
    }
    if any(not e.is_row for e in episodes):
        token_returns = []
        for e in episodes:
            returns = discounted_turn_returns(e.turn_rewards, gamma)
            token_returns.append([returns[t] if returns else 0.0 for t in e.turn_index])
        tensors["turn_returns"] = scatter_response_values(token_returns, prompt_lengths, width)
        non_tensors["status"] = [e.status for e in episodes]
        non_tensors["turns"] = [[] if e.is_row else e.turns for e in episodes]
    return Batch(tensors, non_tensors)


def _env_id(episode: Episode) -> str:
    return f"{episode.tag}-{episode.env_seed}-{episode.episode_id}"


def rollout_metrics(
    episodes: Sequence[Episode], penalty_B: torch.Tensor | None = None
) -> dict[str, float]:
    """``rollout/*``: for rows score and accuracy per domain, response length, truncated
    fraction and the overlong penalty; for environment episodes success per tag, turns, tool
    calls, end statuses (``episode_metrics``); ``rollout/score`` over all."""
    rows = [e for e in episodes if e.is_row]
    envs = [e for e in episodes if not e.is_row]
    metrics: dict[str, float] = {}
    if rows:
        metrics.update(
            domain_metrics(
                "rollout",
                [e.tag for e in rows],
                [e.total_reward for e in rows],
                [e.info for e in rows],
            )
        )
        lengths = [len(e.token_ids) for e in rows]
        metrics["rollout/response_length"] = sum(lengths) / len(lengths)
        metrics["rollout/truncated_fraction"] = sum(
            e.finish_reason == "length" for e in rows
        ) / len(rows)
        if penalty_B is not None:
            metrics["rollout/overlong_penalty"] = float(penalty_B.mean())
    if envs:
        metrics.update(episode_metrics(envs, "rollout"))
        scores = torch.tensor([e.total_reward for e in episodes], dtype=torch.float32)
        metrics["rollout/score"] = float(scores.mean())
    return metrics
