"""Reward functions from config specs, and the weighted-sum combiner.

A reward spec is what a config's ``reward_fns`` holds:

* ``"math_rule"`` - a name with default parameters;
* ``{"name": "format", "weight": 0.1, "preset": "boxed"}`` - a name, an optional ``weight``,
  an optional ``key`` (the name under which its score is reported, default the name) and the
  function's keyword parameters;
* a list of those - their weighted sum (:class:`WeightedSumReward`).

Names are looked up in ``roll_ds.rewards.registry.REWARD_FNS``; a name ``module:Class`` is a
``RewardFn`` subclass of the user's own (``reward_class``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from roll_ds.config.plain import to_plain
from roll_ds.rewards.base import RewardFn, RewardOutput, RewardSample
from roll_ds.rewards.registry import reward_class, reward_name_problem

_SPEC_KEYS = ("name", "weight", "key")


def _split_spec(spec: Any) -> tuple[str, float, str, dict[str, Any]]:
    """``(name, weight, key, params)`` of a single-function spec."""
    spec = to_plain(spec)
    if isinstance(spec, str):
        return spec, 1.0, spec, {}
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"a reward spec is a name or a mapping with 'name', got {spec!r}")
    name = spec["name"]
    if not isinstance(name, str):
        raise ValueError(f"reward spec 'name' must be a string, got {name!r}")
    weight = spec.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
    key = spec.get("key") or name
    params = {k: v for k, v in spec.items() if k not in _SPEC_KEYS}
    return name, float(weight), str(key), params


def _accepted(cls: type) -> tuple[set[str], bool]:
    """Parameter names of ``cls.__init__`` and whether it takes ``**kwargs``."""
    sig = inspect.signature(cls.__init__)
    names = {
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    } - {"self"}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def build_single(spec: Any, defaults: Mapping[str, Any] | None = None) -> RewardFn:
    """One reward function from a spec, ignoring its weight. ``defaults`` (e.g. ``timeout_s``)
    fill parameters the function accepts and the spec does not set."""
    name, _, _, params = _split_spec(spec)
    cls = reward_class(name)
    accepted, var_kw = _accepted(cls)
    unknown = sorted(set(params) - accepted) if not var_kw else []
    if unknown:
        raise ValueError(
            f"reward {name!r}: unknown parameter(s) {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(accepted))}"
        )
    for k, v in (defaults or {}).items():
        if k in accepted and k not in params:
            params[k] = v
    return cls(**params)


def build_reward_fn(spec: Any, defaults: Mapping[str, Any] | None = None) -> RewardFn:
    """A reward function from a spec: a name, a mapping, or a list (weighted sum).

    A single mapping with a weight other than 1 is wrapped in a weighted sum too.
    """
    spec = to_plain(spec)
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return WeightedSumReward(list(spec), defaults=defaults)
    _, weight, _, _ = _split_spec(spec)
    if weight != 1.0:
        return WeightedSumReward([spec], defaults=defaults)
    return build_single(spec, defaults)


def validate_reward_specs(specs: Any) -> list[str]:
    """Problems of a ``reward_fns`` list (unknown names, parameters, weights) without building
    anything heavy: the classes are imported, math-verify is not."""
    specs = to_plain(specs)
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    if not isinstance(specs, Sequence) or not specs:
        return ["reward_fns: expected a non-empty list of reward specs"]
    problems = []
    for i, spec in enumerate(specs):
        try:
            name, _, _, params = _split_spec(spec)
            problem = reward_name_problem(name)
            if problem:
                problems.append(f"reward_fns[{i}]: {problem}")
                continue
            cls = reward_class(name)
            accepted, var_kw = _accepted(cls)
            unknown = sorted(set(params) - accepted) if not var_kw else []
            if unknown:
                problems.append(
                    f"reward_fns[{i}] ({name}): unknown parameter(s) "
                    f"{', '.join(unknown)}; valid: {', '.join(sorted(accepted))}"
                )
            # a function may check its parameters' values: classmethod param_problems(params)
            check = getattr(cls, "param_problems", None)
            problems += [f"reward_fns[{i}] ({name}).{p}" for p in (check(params) if check else [])]
        except ValueError as e:
            problems.append(f"reward_fns[{i}]: {e}")
    return problems


class WeightedSumReward(RewardFn):
    """``sum(weight_i * score_i)`` over component reward functions.

    ``components`` holds specs (see the module doc), or already built functions: a
    :class:`RewardFn` (weight 1) or a ``(RewardFn, weight)`` pair.

    Info per sample: ``rewards`` ({key: unweighted component score}); ``timed_out`` (any
    component timed out); ``error`` ("key: error; ..." or None); and ``correct`` /
    ``format_ok`` / ``extracted`` taken from the first component reporting them.
    """

    name = "weighted_sum"

    def __init__(
        self, components: Sequence[Any], defaults: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        if not components:
            raise ValueError("weighted_sum: no reward functions given")
        self.components: list[tuple[str, float, RewardFn]] = []
        seen: set[str] = set()
        try:
            for spec in components:
                if isinstance(spec, RewardFn):
                    weight, key, fn = 1.0, spec.name, spec
                elif isinstance(spec, tuple) and spec and isinstance(spec[0], RewardFn):
                    fn, weight = spec
                    key, weight = fn.name, float(weight)
                else:
                    _, weight, key, _ = _split_spec(spec)
                    fn = build_single(spec, defaults)
                base_key, n = key, 1
                while key in seen:  # the same function twice: format, format#2
                    n += 1
                    key = f"{base_key}#{n}"
                seen.add(key)
                self.components.append((key, weight, fn))
        except BaseException:
            self.close()
            raise

    @property
    def weights(self) -> dict[str, float]:
        return {key: w for key, w, _ in self.components}

    def warmup(self) -> None:
        for _, _, fn in self.components:
            fn.warmup()

    def close(self) -> None:
        for _, _, fn in getattr(self, "components", []):
            fn.close()

    def score_batch(self, samples: list[RewardSample]) -> RewardOutput:
        n = len(samples)
        totals = [0.0] * n
        infos: list[dict[str, Any]] = [
            {"rewards": {}, "timed_out": False, "error": None} for _ in range(n)
        ]
        for key, weight, fn in self.components:
            out = fn(samples)
            for i in range(n):
                score, sub = out.scores[i], out.infos[i]
                totals[i] += weight * score
                info = infos[i]
                info["rewards"][key] = score
                info["timed_out"] = info["timed_out"] or bool(sub.get("timed_out"))
                if sub.get("error"):
                    err = f"{key}: {sub['error']}"
                    info["error"] = err if info["error"] is None else f"{info['error']}; {err}"
                for shared in (
                    "correct",
                    "format_ok",
                    "extracted",
                    "judge_unparsed",
                    "error_category",  # code: why the program failed
                    "categories",  # code: {category: tests}
                ):
                    if shared in sub and shared not in info:
                        info[shared] = sub[shared]
        return RewardOutput(totals, infos)
