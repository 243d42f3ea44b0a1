"""One evaluation of the policy the rollout engines serve, on held-out rows.

Shared by the training loop (``RLVRPipeline.evaluate``, after syncing the trainer's weights)
and by ``python -m roll_ds.evaluate`` (an exported model or a converted checkpoint), so both
report the same numbers for the same weights. What is reported: ``roll_ds.pipeline.eval_metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.eval_metrics import (
    PREFIX,
    SAMPLED,
    length_metrics,
    pass_ks,
    sampled_metrics,
)
from roll_ds.pipeline.rollout import domain_metrics

Score = Callable[[Batch], None]  # fills ``scores`` and ``reward_info`` (RolloutPhase.score)


def evaluate_policy(
    actor_infer: Any, score: Score, tokenizer: Any, rows: Sequence[dict], cfg: RLVRConfig
) -> dict[str, float]:
    """Greedy accuracy per domain (``eval/accuracy``, ``eval/<domain>/accuracy``, ...) and the
    greedy responses' lengths; with ``validation.num_samples`` also mean@k / pass@k and the
    samples' lengths. ``actor_infer`` is the rollout role, ``score`` sends samples to the
    reward roles."""
    val = cfg.validation
    gen = val.generating_args
    sampling = dict(
        top_p=gen.top_p,
        top_k=gen.top_k,
        max_new_tokens=gen.max_new_tokens or cfg.response_length,
    )
    greedy = generate_and_score(
        actor_infer,
        score,
        tokenizer,
        rows,
        seed=cfg.seed,
        n=1,
        temperature=gen.temperature,
        **sampling,
    )
    metrics = domain_metrics(
        PREFIX, list(greedy["domain"]), greedy["scores"].tolist(), greedy["reward_info"]
    )
    metrics.update(length_metrics(list(greedy["length"]), list(greedy["finish_reason"])))
    if not val.num_samples:
        return metrics
    sampled = generate_and_score(
        actor_infer,
        score,
        tokenizer,
        rows,
        seed=cfg.seed,
        n=val.num_samples,
        temperature=val.sample_temperature,
        **sampling,
    )
    correct = [info.get("correct") for info in sampled["reward_info"]]
    metrics.update(
        sampled_metrics(list(sampled["row"]), list(sampled["domain"]), correct, pass_ks(val))
    )
    metrics.update(
        length_metrics(
            list(sampled["length"]), list(sampled["finish_reason"]), f"{PREFIX}/{SAMPLED}"
        )
    )
    return metrics


def generate_and_score(
    actor_infer: Any,
    score: Score,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    seed: int,
    **sampling: Any,
) -> Batch:
    """``sampling["n"]`` responses per row (grouped by row), decoded and scored: a batch with
    ``row`` (index into ``rows``), ``prompt``, ``ground_truth``, ``domain``, ``response_text``,
    ``length`` (tokens), ``finish_reason``, ``scores`` and ``reward_info``."""
    prompt_batch = Batch(
        non_tensors={"prompt_ids": [r["prompt_ids"] for r in rows], "row": range(len(rows))}
    )
    out = actor_infer.generate(prompt_batch, seed=seed, **sampling)
    picked = [rows[r] for r in out["row"]]
    samples = Batch(
        non_tensors={
            "row": list(out["row"]),
            "prompt": [r["prompt"] for r in picked],
            "ground_truth": [r["ground_truth"] for r in picked],
            "domain": [r["domain"] for r in picked],
            "response_text": [
                tokenizer.decode(ids, skip_special_tokens=True) for ids in out["response_ids"]
            ],
            "length": [len(ids) for ids in out["response_ids"]],
            "finish_reason": list(out["finish_reason"]),
        }
    )
    score(samples)
    return samples
