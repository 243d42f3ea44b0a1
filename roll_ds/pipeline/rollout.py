"""Pure pieces of the rollout phase: routing data domains to reward roles, and the score and
accuracy metrics per domain (training rollouts and evaluation alike)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np


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
