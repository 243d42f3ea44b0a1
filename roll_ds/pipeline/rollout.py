"""Driver-side rollout bookkeeping: prompts in, a scored and packed training batch out.

Pure functions over plain Python and torch (no Ray), so each step of the RLVR loop is testable
on its own: joining generations with their prompts, routing responses to reward roles by
domain, DAPO's overlong penalty, group filtering for dynamic sampling, and the metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from roll_ds.algorithms.masks import overlong_soft_penalty
from roll_ds.config.schema import AlgorithmConfig
from roll_ds.distributed.batch import Batch


def domain_routes(
    domains: Sequence[str], tag_included: Mapping[str, Sequence[str]]
) -> dict[str, str]:
    """``{domain: reward role}``; every data domain must be claimed by exactly one role."""
    routes: dict[str, str] = {}
    problems = []
    for role, tags in tag_included.items():
        for tag in tags:
            if tag in routes:
                problems.append(
                    f"rewards.{role}.tag_included: domain {tag!r} is also in {routes[tag]}"
                )
            routes[tag] = role
    missing = sorted(set(domains) - set(routes))
    if missing:
        problems.append(
            f"rewards: no reward role scores the data domains {missing}; add them to a role's "
            "tag_included"
        )
    if problems:
        raise ValueError("\n".join(problems))
    return routes


def group_has_signal(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[num_groups]`` bool: the group's rewards are not all equal (it carries a gradient)."""
    groups = scores_B.view(-1, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > 1e-6


def domain_metrics(
    prefix: str, domains: Sequence[str], scores: Sequence[float], infos: Sequence[Mapping]
) -> dict[str, float]:
    """Mean score and accuracy (where the reward reports ``correct``), overall and per domain."""
    out: dict[str, float] = {}
    domains_arr = np.asarray(domains, dtype=object)
    scores_arr = np.asarray(scores, dtype=np.float64)
    correct = np.asarray([bool(i.get("correct", False)) for i in infos])
    has_correct = np.asarray(["correct" in i for i in infos])
    for name in [None, *sorted(set(domains))]:
        sel = np.ones(len(scores_arr), bool) if name is None else domains_arr == name
        tag = f"{prefix}/" if name is None else f"{prefix}/{name}/"
        if not sel.any():
            continue
        out[f"{tag}score"] = float(scores_arr[sel].mean())
        if has_correct[sel].any():
            out[f"{tag}accuracy"] = float(correct[sel & has_correct].mean())
    out[f"{prefix}/timeouts"] = float(sum(bool(i.get("timed_out")) for i in infos))
    out[f"{prefix}/errors"] = float(sum(bool(i.get("error")) for i in infos))
    out.update(_failure_counts(prefix, infos))
    return out


def _failure_counts(prefix: str, infos: Sequence[Mapping]) -> dict[str, float]:
    """Rewards that say *why* a sample failed: the code reward's ``error_category`` (timeout,
    memory, output_limit, ...; ``passed`` is not a failure) and the judge's unparsed verdicts,
    as counts of samples (only the keys some sample reported)."""
    out: dict[str, float] = {}
    categories = Counter(
        i["error_category"] for i in infos if i.get("error_category") not in (None, "passed")
    )
    for category, n in sorted(categories.items()):
        out[f"{prefix}/failures/{category}"] = float(n)
    if any("judge_unparsed" in i for i in infos):
        out[f"{prefix}/judge_unparsed"] = float(sum(bool(i.get("judge_unparsed")) for i in infos))
    return out


def fit_dynamic_batch(
    kept: list[Batch], spare: list[Batch], group: int, want: int
) -> tuple[Batch, int]:
    """Dynamic sampling's batch of exactly ``want`` groups: the first ``want`` kept groups, or
    all of them followed by groups without signal from ``spare`` (never a kept group twice).
    Returns the batch and how many of its last rows are such padding. Enough spare groups
    always exist: every round draws ``want`` groups, each either kept or spare."""
    batch = Batch.concat([b for b in kept if len(b)]) if any(len(b) for b in kept) else None
    have = len(batch) // group if batch is not None else 0
    if have >= want:
        return batch.index(list(range(want * group))), 0
    pool = Batch.concat([b for b in spare if len(b)])
    pad_rows = (want - have) * group
    if len(pool) < pad_rows:
        raise RuntimeError(f"dynamic sampling: {len(pool)} spare rows for {pad_rows} padding rows")
    pad = pool.index(list(range(pad_rows)))
    return (Batch.concat([batch, pad]) if batch is not None else pad), pad_rows


def join_samples(prompts: Sequence[Mapping], out: Mapping[str, Any], tokenizer: Any) -> Batch:
    """The generation output ``out`` (``row``, ``response_ids``, ``rollout_logprobs``,
    ``finish_reason``) joined with its prompts' rows and decoded."""
    rows = [prompts[r] for r in out["row"]]
    text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out["response_ids"]]
    return Batch(
        non_tensors={
            "prompt_ids": [r["prompt_ids"] for r in rows],
            "prompt": [r["prompt"] for r in rows],
            "ground_truth": [r["ground_truth"] for r in rows],
            "domain": [r["domain"] for r in rows],
            "id": [r["id"] for r in rows],
            "response_ids": out["response_ids"],
            "response_text": text,
            "rollout_logprobs": out["rollout_logprobs"],
            "finish_reason": out["finish_reason"],
        }
    )


def apply_overlong_penalty(
    samples: Batch, algo: AlgorithmConfig, response_length: int
) -> torch.Tensor | None:
    """DAPO's soft overlong punishment (``algorithm.overlong_buffer_len`` > 0), added to
    the training rollouts' scores before advantages and dynamic sampling see them; returns the
    penalty ``[B]`` (None: off)."""
    if not algo.overlong_buffer_len:
        return None
    lengths_B = torch.tensor([len(r) for r in samples["response_ids"]])
    penalty_B = overlong_soft_penalty(
        lengths_B, response_length, algo.overlong_buffer_len, algo.overlong_penalty_factor
    )
    samples.tensors["scores"] = samples["scores"] + penalty_B
    return penalty_B


def rollout_metrics(samples: Batch) -> dict[str, float]:
    """``rollout/*``: score and accuracy per domain, response length, truncated fraction."""
    metrics = domain_metrics(
        "rollout", list(samples["domain"]), samples["scores"].tolist(), samples["reward_info"]
    )
    lengths = [len(r) for r in samples["response_ids"]]
    metrics["rollout/response_length"] = sum(lengths) / len(lengths)
    metrics["rollout/truncated_fraction"] = sum(
        f == "length" for f in samples["finish_reason"]
    ) / len(lengths)
    return metrics
