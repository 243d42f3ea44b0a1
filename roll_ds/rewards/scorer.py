"""``RewardScorer``: the object a reward worker (a Ray CPU actor) hosts for one domain.

It is built from a plain config dict — the ``rewards.<domain>`` section of the pipeline config:

    {"reward_fns": [{"name": "math_rule", "weight": 1.0},
                    {"name": "format", "weight": 0.1, "preset": "boxed"}],
     "timeout_s": 5.0}

Other keys of that section (``tag_included``, ``world_size``, ...) are ignored. ``timeout_s`` is
the default per-sample timeout of every reward function that takes one. ``score(rows,
responses)`` returns the per-sample scores, infos and batch metrics, and never raises for bad
responses (only for a caller error such as mismatched lengths).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from roll_ds.config.plain import to_plain
from roll_ds.rewards.base import RewardFn, RewardSample
from roll_ds.rewards.build import WeightedSumReward

DEFAULT_TIMEOUT_S = 5.0


def _plain_config(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    config = to_plain(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"RewardScorer config must be a mapping, got {type(config).__name__}")
    return dict(config)


def _rate(infos: list[dict[str, Any]], key: str) -> float | None:
    values = [bool(info[key]) for info in infos if key in info]
    return sum(values) / len(values) if values else None


def compute_metrics(scores: Sequence[float], infos: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Batch metrics: ``num_samples``, ``score_mean/std/min/max``, ``accuracy`` (share of
    ``correct``), ``format_rate`` (share of ``format_ok``), ``num_timeouts``, ``num_errors`` and
    ``score_mean/<key>`` per combined component. Rates are left out when no sample reports them.
    """
    n = len(scores)
    infos = list(infos)
    metrics: dict[str, float] = {
        "num_samples": n,
        "num_timeouts": sum(1 for i in infos if i.get("timed_out")),
        "num_errors": sum(1 for i in infos if i.get("error")),
    }
    if n:
        mean = sum(scores) / n
        metrics.update(
            score_mean=mean,
            score_std=math.sqrt(sum((s - mean) ** 2 for s in scores) / n),
            score_min=min(scores),
            score_max=max(scores),
        )
    for key, name in (("correct", "accuracy"), ("format_ok", "format_rate")):
        rate = _rate(infos, key)
        if rate is not None:
            metrics[name] = rate
    if any("judge_unparsed" in i for i in infos):  # a generative judge's unreadable verdicts
        metrics["judge_unparsed"] = sum(1 for i in infos if i.get("judge_unparsed"))
    components: dict[str, list[float]] = {}
    for info in infos:
        for key, value in info.get("rewards", {}).items():
            components.setdefault(key, []).append(value)
    for key, values in components.items():
        metrics[f"score_mean/{key}"] = sum(values) / len(values)
    return metrics


class RewardScorer:
    """Scores one domain's batches with the configured (weighted) reward functions."""

    def __init__(
        self, config: Any = None, *, resources: Mapping[str, Any] | None = None, **overrides: Any
    ) -> None:
        """``resources``: objects for the reward functions that take them by name (a role's
        reward model ``reward_model``, its ``judge``; see ``rewards/model_reward.py``)."""
        cfg = {**_plain_config(config), **overrides}
        specs = cfg.get("reward_fns")
        if not specs:
            raise ValueError(
                "RewardScorer: config has no reward_fns, e.g. "
                "[{'name': 'math_rule', 'weight': 1.0}]"
            )
        timeout_s = cfg.get("timeout_s", DEFAULT_TIMEOUT_S)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        if isinstance(specs, (str, Mapping)):
            specs = [specs]
        # Always a weighted sum, so per-component scores are reported even for one function.
        self.reward_fn: RewardFn = WeightedSumReward(
            list(specs), defaults={"timeout_s": self.timeout_s, **(resources or {})}
        )

    @classmethod
    def from_specs(
        cls, reward_fns: Any, timeout_s: float | None = DEFAULT_TIMEOUT_S
    ) -> RewardScorer:
        return cls({"reward_fns": reward_fns, "timeout_s": timeout_s})

    @property
    def weights(self) -> dict[str, float]:
        return self.reward_fn.weights  # type: ignore[attr-defined]

    def warmup(self) -> None:
        """Start worker processes / import math-verify now instead of on the first batch."""
        self.reward_fn.warmup()

    def close(self) -> None:
        self.reward_fn.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(
        self, batch_rows: Sequence[Mapping[str, Any]], responses: Sequence[str]
    ) -> dict[str, Any]:
        """Score ``responses[i]`` against ``batch_rows[i]["ground_truth"]``.

        Returns ``{"scores": list[float], "infos": list[dict], "metrics": dict}``; see
        :func:`compute_metrics` for the metrics, plus ``time_s`` (wall time of the scoring).
        """
        if len(batch_rows) != len(responses):
            raise ValueError(
                f"RewardScorer.score: {len(batch_rows)} rows but {len(responses)} responses"
            )
        samples = [
            RewardSample(
                "" if resp is None else str(resp), row.get("ground_truth"), row.get("prompt") or ""
            )
            for row, resp in zip(batch_rows, responses, strict=True)
        ]
        start = time.perf_counter()
        out = self.reward_fn(samples)
        elapsed = time.perf_counter() - start
        metrics = compute_metrics(out.scores, out.infos)
        metrics["time_s"] = elapsed
        return {"scores": list(out.scores), "infos": out.infos, "metrics": metrics}
