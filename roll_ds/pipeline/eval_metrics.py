"""The numbers an evaluation reports, as pure functions, and the names they go by.

``RLVRPipeline.evaluate`` (through ``roll_ds.pipeline.evaluation``) reports, per domain and
overall:

- ``eval/accuracy`` / ``eval/score``: the greedy answer (``validation.generating_args``);
- with ``validation.num_samples: k``, from k samples per prompt at ``sample_temperature``:
  ``eval/mean@k`` (the mean accuracy of one sample: what a user sampling at that temperature
  gets on average) and ``eval/pass@j`` for the configured ``pass_k`` (the chance that at least
  one of j samples is right, by the unbiased estimator of Chen et al. 2021 from all k);
- ``eval/response_length/{mean,p50,p90,max}`` and ``eval/truncated_fraction`` of the greedy
  responses (``eval/sampled/...`` of the samples): an accuracy that rises because answers got
  cut off, or that falls because they ramble past ``max_new_tokens``, shows here.

No torch, Ray or vLLM: ``roll_ds.config.validate`` imports ``eval_config_problems`` from here.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig, ValidationConfig

PREFIX = "eval"
SAMPLED = "sampled"  # eval/sampled/...: length statistics of the k samples
SAVE_BEST_MODES = ("max", "min")
# Per domain (eval/<domain>/<name>) and overall (eval/<name>): greedy metrics of domain_metrics.
GREEDY_NAMES = ("score", "accuracy")
LENGTH_NAMES = (
    "response_length/mean",
    "response_length/p50",
    "response_length/p90",
    "response_length/max",
    "truncated_fraction",
)


# --- math ------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k, the chance that at least one of ``k`` samples is correct,
    from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code", eq. 1). Drawing only k samples
    and checking them would estimate the same quantity with more variance."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one rounding


def default_pass_ks(num_samples: int) -> list[int]:
    """1, 2, 4, ... below ``num_samples``, then ``num_samples`` itself."""
    ks, k = [], 1
    while k < num_samples:
        ks.append(k)
        k *= 2
    return [*ks, num_samples] if num_samples >= 1 else []


def pass_ks(validation: ValidationConfig) -> list[int]:
    """The ks of ``eval/pass@k`` for ``validation`` (sorted, no repeats)."""
    return sorted(set(validation.pass_k)) or default_pass_ks(validation.num_samples)


def sampled_metrics(
    prompts: Sequence[Hashable],
    domains: Sequence[str],
    correct: Sequence[bool | None],
    ks: Iterable[int],
    prefix: str = PREFIX,
) -> dict[str, float]:
    """``<prefix>/mean@n`` and ``<prefix>/pass@k`` overall and per domain, from one row per
    sample: its prompt, the prompt's domain and whether it is correct (None: the domain's
    reward reports no correctness; such samples are left out, as ``domain_metrics`` leaves them
    out of accuracy). ``n`` is the samples per prompt (the fewest any prompt has); a k above
    it is skipped. Each prompt counts once, however many samples it has."""
    counts: dict[Hashable, list[int]] = {}  # prompt -> [samples, correct]
    domain_of: dict[Hashable, str] = {}
    for prompt, domain, ok in zip(prompts, domains, correct, strict=True):
        if ok is None:
            continue
        n_c = counts.setdefault(prompt, [0, 0])
        n_c[0] += 1
        n_c[1] += int(bool(ok))
        domain_of[prompt] = domain
    if not counts:
        return {}
    n = min(n for n, _ in counts.values())
    ks = sorted(k for k in set(ks) if 1 <= k <= n)
    out: dict[str, float] = {}
    for domain in [None, *sorted(set(domain_of.values()))]:
        rows = [nc for p, nc in counts.items() if domain is None or domain_of[p] == domain]
        tag = prefix if domain is None else f"{prefix}/{domain}"
        out[f"{tag}/mean@{n}"] = _mean(c / m for m, c in rows)
        for k in ks:
            out[f"{tag}/pass@{k}"] = _mean(pass_at_k(m, c, k) for m, c in rows)
    return out


def length_metrics(
    lengths: Sequence[int], finish_reasons: Sequence[str], prefix: str = PREFIX
) -> dict[str, float]:
    """Response lengths in tokens (mean, median, 90th percentile, max) and the fraction that
    stopped at ``max_new_tokens`` (finish reason ``length``)."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    return {
        f"{prefix}/response_length/mean": _mean(ordered),
        f"{prefix}/response_length/p50": percentile(ordered, 50),
        f"{prefix}/response_length/p90": percentile(ordered, 90),
        f"{prefix}/response_length/max": float(ordered[-1]),
        f"{prefix}/truncated_fraction": sum(r == "length" for r in finish_reasons) / len(lengths),
    }


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, interpolating linearly between the two nearest
    ranks (numpy's default)."""
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(sum(values) / len(values))


# --- names and config checks -----------------------------------------------------------------


def eval_metric_names(validation: ValidationConfig, domains: Iterable[str]) -> list[str]:
    """Every metric an evaluation with ``validation`` can report for data of ``domains``."""
    per_domain = list(GREEDY_NAMES)
    if validation.num_samples:
        per_domain += [f"mean@{validation.num_samples}"]
        per_domain += [f"pass@{k}" for k in pass_ks(validation) if k <= validation.num_samples]
    names = [f"{PREFIX}/{n}" for n in per_domain]
    names += [f"{PREFIX}/{d}/{n}" for d in sorted(set(domains)) for n in per_domain]
    names += [f"{PREFIX}/timeouts", f"{PREFIX}/errors"]
    names += [f"{PREFIX}/{n}" for n in LENGTH_NAMES]
    if validation.num_samples:
        names += [f"{PREFIX}/{SAMPLED}/{n}" for n in LENGTH_NAMES]
    return names


def eval_config_problems(cfg: RLVRConfig) -> list[str]:
    """Problems of ``validation``'s sampling fields and of ``save_best`` (one line each, naming
    the field and the fix); hooked into ``roll_ds.config.validate``."""
    val = cfg.validation
    problems = []
    if val.num_samples < 0:
        problems.append(
            f"validation.num_samples: must be >= 0 (0: greedy accuracy only), got {val.num_samples}"
        )
    if not val.sample_temperature > 0:
        problems.append(
            "validation.sample_temperature: must be > 0 (k samples at temperature 0 are k "
            f"copies of the greedy answer), got {val.sample_temperature}"
        )
    bad = [k for k in val.pass_k if not 1 <= k <= max(val.num_samples, 0)]
    if bad:
        problems.append(
            f"validation.pass_k: {bad} outside 1..validation.num_samples "
            f"({val.num_samples}); pass@k needs at least k samples per prompt: raise "
            "num_samples or drop those ks"
        )
    return problems + _save_best_problems(cfg)


def _save_best_problems(cfg: RLVRConfig) -> list[str]:
    problems = []
    if cfg.save_best_mode not in SAVE_BEST_MODES:
        problems.append(
            f"save_best_mode: must be one of {', '.join(SAVE_BEST_MODES)}, got "
            f"{cfg.save_best_mode!r}"
        )
    metric = cfg.save_best
    if metric is None:
        return problems
    domains = {d for reward in cfg.rewards.values() for d in reward.tag_included}
    valid = eval_metric_names(cfg.validation, domains)
    if metric not in valid:
        what = "is not an eval metric" if not metric.startswith(f"{PREFIX}/") else "is unknown"
        problems.append(
            f"save_best: {metric!r} {what}; name one this config's evaluation reports, such as "
            f"{PREFIX}/accuracy (valid: {', '.join(valid)})"
        )
    if not cfg.save_steps or not cfg.eval_steps:
        problems.append(
            f"save_best: {metric!r} keeps the best of the checkpoints that save_steps writes, "
            f"by the eval that eval_steps runs; set both (now save_steps={cfg.save_steps}, "
            f"eval_steps={cfg.eval_steps})"
        )
    elif cfg.save_steps % cfg.eval_steps:
        problems.append(
            f"save_best: a checkpoint is compared by the eval of its own step, so save_steps "
            f"({cfg.save_steps}) must be a multiple of eval_steps ({cfg.eval_steps})"
        )
    return problems
