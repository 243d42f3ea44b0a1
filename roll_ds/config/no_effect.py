"""Settings that are valid but have no effect with the rest of the config.

``config_warnings`` returns one line per such setting, naming the field and when it does apply;
``validate.validate`` logs them as ``config:`` warnings before anything starts. A setting counts as
set when it differs from its schema default.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from roll_ds.config.estimators import (
    ALWAYS_WHITENED,
    ESTIMATOR_OPTIONS,
    estimators_using,
    needs_critic,
)
from roll_ds.config.schema import AlgorithmConfig, RLVRConfig


def config_warnings(cfg: RLVRConfig) -> list[str]:
    """Settings that are valid but have no effect with the rest of ``cfg``, one line each naming
    the field and when it does apply."""
    if cfg.algorithm.adv_estimator not in ESTIMATOR_OPTIONS:
        return []  # reported as a problem
    return (
        _estimator_warnings(cfg)
        + _loss_warnings(cfg.algorithm)
        + _kl_warnings(cfg)
        + _pipeline_warnings(cfg)
    )


def _changed(section: Any, name: str) -> bool:
    """Whether ``section.name`` differs from its schema default."""
    default = {f.name: f.default for f in fields(section)}[name]
    return getattr(section, name) != default


def _estimator_warnings(cfg: RLVRConfig) -> list[str]:
    algo = cfg.algorithm
    estimator = algo.adv_estimator
    warnings = []
    for option in ("gamma", "lam"):
        if _changed(algo, option) and option not in ESTIMATOR_OPTIONS[estimator]:
            warnings.append(
                f"algorithm.{option}={getattr(algo, option)} has no effect with adv_estimator "
                f"{estimator!r}; it is used by {', '.join(estimators_using(option))}"
            )
    if algo.whiten_advantages and estimator in ALWAYS_WHITENED:
        warnings.append(
            f"algorithm.whiten_advantages has no effect with adv_estimator {estimator!r}, whose "
            "advantages are always whitened"
        )
    if not algo.dynamic_sampling and _changed(algo, "max_resample_rounds"):
        warnings.append(
            f"algorithm.max_resample_rounds={algo.max_resample_rounds} has no effect while "
            "algorithm.dynamic_sampling is false"
        )
    if needs_critic(estimator):
        return warnings
    critic_users = ", ".join(e for e in sorted(ESTIMATOR_OPTIONS) if needs_critic(e))
    if cfg.critic is not None:
        warnings.append(
            f"critic: configured but adv_estimator {estimator!r} uses no critic; the role is "
            f"not started (it is used by {critic_users})"
        )
    for option in ("value_clip", "vf_coef"):
        if _changed(algo, option):
            warnings.append(
                f"algorithm.{option}={getattr(algo, option)} has no effect with adv_estimator "
                f"{estimator!r} (no critic); it is used by {critic_users}"
            )
    return warnings


def _loss_warnings(algo: AlgorithmConfig) -> list[str]:
    """Clip ranges of the other ratio level, and the overlong penalty's factor without a buffer."""
    level = algo.ratio_level
    unused = {"token": ("seq_clip_low", "seq_clip_high"), "sequence": ("clip_low", "clip_high")}
    used_by = {"token": "sequence", "sequence": "token"}
    warnings = [
        f"algorithm.{option}={getattr(algo, option)} has no effect with ratio_level {level!r}; "
        f"it is used by ratio_level {used_by[level]!r}"
        for option in unused.get(level, ())
        if _changed(algo, option)
    ]
    warnings += _correction_warnings(algo)
    if algo.overlong_buffer_len == 0 and _changed(algo, "overlong_penalty_factor"):
        warnings.append(
            f"algorithm.overlong_penalty_factor={algo.overlong_penalty_factor} has no effect "
            "while algorithm.overlong_buffer_len is 0; set overlong_buffer_len to the tokens "
            "before response_length where the penalty starts"
        )
    return warnings


# Which rollout corrections read which bounds (roll_ds/algorithms/corrections.py)
CORRECTION_BOUNDS = {
    "token_tis": ("tis_cap",),
    "seq_tis": ("tis_cap",),
    "icepop": ("correction_low", "correction_high"),
    "geo_mask": ("correction_low", "correction_high"),
}


def _correction_warnings(algo: AlgorithmConfig) -> list[str]:
    """Bounds that the chosen rollout correction does not read."""
    name = algo.rollout_correction
    if name is None:  # tis_cap alone selects token_tis; the low / high bounds are unread
        used: tuple[str, ...] = ("tis_cap",)
    else:
        used = CORRECTION_BOUNDS.get(name, ())
    return [
        f"algorithm.{option}={getattr(algo, option)} has no effect with rollout_correction "
        f"{name!r}; it is read by "
        + ", ".join(n for n, bounds in CORRECTION_BOUNDS.items() if option in bounds)
        for option in ("tis_cap", "correction_low", "correction_high")
        if option not in used and getattr(algo, option) is not None
    ]


def _kl_warnings(cfg: RLVRConfig) -> list[str]:
    """KL settings without a KL term, and reference log-probs that nothing reads."""
    algo = cfg.algorithm
    if algo.kl_coef == 0:
        warnings = [
            f"algorithm.{option}={getattr(algo, option)} has no effect while algorithm.kl_coef is 0"
            for option in ("kl_in_reward", "kl_estimator")
            if _changed(algo, option)
        ]
        if cfg.reference is not None:
            warnings.append(
                "reference: configured but algorithm.kl_coef is 0; the role starts and its "
                "log-probs are never used (set kl_coef > 0 or remove `reference:`)"
            )
        return warnings
    if not algo.use_kl_loss and not algo.kl_in_reward:
        return [
            f"algorithm.kl_coef={algo.kl_coef}: reference log-probs are computed every step but "
            "nothing uses them (algorithm.use_kl_loss and algorithm.kl_in_reward are both "
            "false); set one of them to true, or kl_coef=0"
        ]
    if algo.use_kl_loss and algo.kl_in_reward:
        return [
            "algorithm.use_kl_loss has no effect while algorithm.kl_in_reward is true (the KL "
            "goes into the reward only); set use_kl_loss=false"
        ]
    return []


def _pipeline_warnings(cfg: RLVRConfig) -> list[str]:
    warnings = []
    if cfg.save_steps == 0 and _changed(cfg, "keep_last"):
        warnings.append(
            f"keep_last={cfg.keep_last} has no effect while save_steps is 0 (no checkpoints)"
        )
    if cfg.eval_steps == 0 and cfg.validation.max_prompts is not None:
        warnings.append(
            f"validation.max_prompts={cfg.validation.max_prompts} has no effect while eval_steps "
            "is 0 (no evaluation)"
        )
    sync = cfg.weight_sync
    if not sync.parity_check:
        warnings += [
            f"weight_sync.{option}={getattr(sync, option)} has no effect while "
            "weight_sync.parity_check is false"
            for option in ("parity_probe_size", "parity_max_abs_diff")
            if _changed(sync, option)
        ]
    return warnings
