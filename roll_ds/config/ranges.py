"""The allowed values of every scalar field of the schema, as data.

One table per schema section maps a field to a ``Range`` (numeric bounds, optionally null) or a
``OneOf`` (a fixed set of names). ``field_problems`` applies a table to a config section and
returns one line per bad value naming the dotted field, the allowed values and what the special
values mean, e.g. ``actor_train.training_args.per_device_train_batch_size: must be >= 1, got 0``.
Cross-field rules (batch arithmetic, lengths against the rollout engine) live in ``validate.py``.

Names that registries define in modules importing torch (loss aggregation modes, KL estimators,
ratio levels, LR schedules) are listed here so that validation stays importable without torch;
``tests/unit/config/test_config_validation.py`` checks each list against its registry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from roll_ds.config.schema import ATTN_IMPLEMENTATIONS, DTYPES

# = roll_ds.algorithms.aggregation.AGG_MODES
LOSS_AGG_MODES = (
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-mean",
)
KL_ESTIMATORS = ("k1", "k2", "k3")  # = roll_ds.algorithms.kl.KL_ESTIMATORS
RATIO_LEVELS = ("token", "sequence")  # = roll_ds.algorithms.policy_loss.RATIO_LEVELS
LR_SCHEDULES = ("constant", "linear", "cosine")  # = strategies._common.SCHEDULES
TEMPLATES = ("raw", "chat")  # roll_ds.data.prompts.prompt_token_ids
OLD_LOGPROBS = ("recompute", "rollout", "auto")  # roll_ds.pipeline.rlvr
# = roll_ds.algorithms.corrections.CORRECTIONS
ROLLOUT_CORRECTIONS = ("geo_mask", "icepop", "seq_tis", "token_tis")
# The largest seed: vLLM refuses an engine or request seed outside 0..2**32 - 1 (numpy's range
# too), and it would do so only once the actors run.
SEED_MAX = 2**32 - 1


@dataclass(frozen=True)
class Range:
    """Numbers from ``low`` to ``high`` (either may be open or absent); ``null`` says what a
    null value means, and allows it."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    null: str | None = None
    note: str | None = None  # what a boundary value means, e.g. "0: off"

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_number(self.low)}, {_number(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            text = f"{'<' if self.high_open else '<='} {_number(self.high)}"
        notes = [n for n in (self.note, f"or null: {self.null}" if self.null else None) if n]
        return text + (f" ({'; '.join(notes)})" if notes else "")

    def problem(self, field: str, value: Any) -> str | None:
        if value is None:
            return None if self.null else f"{field}: must be {self.describe()}, got null"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{field}: must be a number {self.describe()}, got {value!r}"
        if self.contains(value):
            return None
        return f"{field}: must be {self.describe()}, got {value}"


def _number(bound: float) -> str:
    """A bound as written: integers in full (2**32 - 1 is 4294967295, not 4.29497e+09)."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


@dataclass(frozen=True)
class OneOf:
    """One of ``choices`` (``None`` among them: null allowed)."""

    choices: tuple[Any, ...]

    def problem(self, field: str, value: Any) -> str | None:
        if value in self.choices:
            return None
        valid = ", ".join("null" if c is None else str(c) for c in self.choices)
        return f"{field}: {value!r} is not one of {valid}"


Rule = Range | OneOf

AT_LEAST_1 = Range(low=1)
POSITIVE = Range(low=0, low_open=True)
UNIT_OPEN = Range(low=0, high=1, high_open=True)  # [0, 1)
SEED_NOTE = "vLLM's seed range; -1 does not mean random here, pick a seed"

PIPELINE: dict[str, Rule] = {
    "seed": Range(low=0, high=SEED_MAX, note=SEED_NOTE),
    "num_gpus_per_node": Range(low=1, note="devices per node"),
    "num_nodes": AT_LEAST_1,
    "max_steps": AT_LEAST_1,
    "rollout_batch_size": AT_LEAST_1,
    "num_return_sequences_in_group": AT_LEAST_1,
    "prompt_length": AT_LEAST_1,
    "response_length": AT_LEAST_1,
    "save_steps": Range(low=0, note="0: no periodic checkpoints"),
    "keep_last": Range(low=0, note="0: keep every checkpoint"),
    "logging_steps": Range(low=0, note="0 or 1: every step"),
    "eval_steps": Range(low=0, note="0: no periodic evaluation"),
}

ALGORITHM: dict[str, Rule] = {
    "ppo_epochs": AT_LEAST_1,
    "gamma": Range(low=0, high=1),
    "lam": Range(low=0, high=1),
    "value_clip": Range(low=0, low_open=True, null="no value clipping"),
    "vf_coef": POSITIVE,
    "clip_low": UNIT_OPEN,
    "clip_high": Range(low=0),
    "dual_clip": Range(low=1, low_open=True, null="no dual clip"),
    "ratio_level": OneOf(RATIO_LEVELS),
    "seq_clip_low": UNIT_OPEN,
    "seq_clip_high": Range(low=0),
    "loss_agg_mode": OneOf(LOSS_AGG_MODES),
    "kl_estimator": OneOf(KL_ESTIMATORS),
    "kl_coef": Range(low=0, note="0: no KL to the reference"),
    "entropy_coef": Range(low=0, note="0: no entropy bonus"),
    "max_resample_rounds": Range(low=1, note="1: no resampling"),
    "rollout_correction": OneOf((None, *ROLLOUT_CORRECTIONS)),
    "tis_cap": Range(
        low=0,
        low_open=True,
        null="2.0 with token_tis, seq_tis or async_generation; else no correction",
    ),
    "correction_low": Range(
        low=0, high=1, low_open=True, high_open=True, null="the rollout correction's default"
    ),
    "correction_high": Range(low=1, low_open=True, null="the rollout correction's default"),
    "overlong_buffer_len": Range(low=0, note="0: no overlong penalty"),
    "overlong_penalty_factor": Range(low=0),
    "old_logprobs": OneOf(OLD_LOGPROBS),
}

ASYNC_GENERATION: dict[str, Rule] = {
    "max_staleness": Range(low=0, note="0: the synchronous loop"),
}

TRAINING_ARGS: dict[str, Rule] = {
    "learning_rate": POSITIVE,
    "weight_decay": Range(low=0),
    "adam_beta1": UNIT_OPEN,
    "adam_beta2": UNIT_OPEN,
    "adam_epsilon": POSITIVE,
    "per_device_train_batch_size": AT_LEAST_1,
    "gradient_accumulation_steps": AT_LEAST_1,
    "warmup_steps": Range(low=0),
    "lr_scheduler_type": OneOf(LR_SCHEDULES),
    "max_grad_norm": Range(low=0, note="0: no gradient clipping"),
}

GENERATING_ARGS: dict[str, Rule] = {
    "max_new_tokens": Range(low=1, null="response_length"),
    "temperature": Range(low=0, note="0: greedy"),
    "top_p": Range(low=0, high=1, low_open=True),
    "top_k": Range(low=-1, note="-1 or 0: off"),
    "num_return_sequences": AT_LEAST_1,
    "seed": Range(low=0, high=SEED_MAX, null="unseeded, unless the caller seeds", note=SEED_NOTE),
}

MODEL_ARGS: dict[str, Rule] = {
    "dtype": OneOf(DTYPES),
    "attn_implementation": OneOf(tuple(ATTN_IMPLEMENTATIONS)),
    "lora_rank": Range(low=1, null="no LoRA"),
    "lora_alpha": Range(low=0, low_open=True, null="2 x lora_rank"),
    "lora_dropout": UNIT_OPEN,
}

DATA_ARGS: dict[str, Rule] = {
    "template": OneOf(TEMPLATES),
    "max_samples": Range(low=1, null="every row"),
}

WORKER: dict[str, Rule] = {
    "infer_batch_size": AT_LEAST_1,
    "max_tokens_per_micro_batch": Range(low=1, null="micro-batches by rows"),
    "sequence_parallel_size": AT_LEAST_1,
    "num_threads": Range(low=1, null="roll_ds/threads.py decides"),
}
REWARD: dict[str, Rule] = {"timeout_s": POSITIVE}

WEIGHT_SYNC: dict[str, Rule] = {
    "bucket_bytes": AT_LEAST_1,
    "timeout_s": POSITIVE,
    "min_gib_per_s": POSITIVE,
    "parity_probe_size": AT_LEAST_1,
    "parity_max_abs_diff": Range(low=0, low_open=True, null="the default of the rollout dtype"),
}

# The least bound of an actor call that can succeed: every call crosses Ray twice and moves its
# batch through the object store, and the calls it bounds do a step's work (a train step, a
# log-prob pass, a checkpoint save: seconds even for the embedded model on a CPU). A smaller
# bound times every call out, and each timeout is treated as a stuck worker: replaced or
# restarted until the budgets are spent.
MIN_CALL_TIMEOUT_S = 10.0

FAULT_TOLERANCE: dict[str, Rule] = {
    "max_restarts": Range(low=0, note="0: a dead worker stops the run"),
    "call_timeout_s": Range(
        low=MIN_CALL_TIMEOUT_S,
        note="seconds; below it no train step or scoring call can finish and every call would "
        "time out into a replacement or restart",
    ),
    "per_token_s": Range(low=0),
    "convert_min_mib_per_s": POSITIVE,
    "max_trainer_restarts": Range(low=0, note="0: a failed trainer rank stops the run"),
    "process_group_timeout_s": POSITIVE,
}

RAY: dict[str, Rule] = {"num_cpus": Range(low=1, null="all CPUs of the machine")}
TRACKING: dict[str, Rule] = {"dump_rollouts_every": Range(low=0, note="0: never")}
VALIDATION: dict[str, Rule] = {"max_prompts": Range(low=1, null="every held-out row")}


def field_problems(prefix: str, section: Any, rules: Mapping[str, Rule]) -> list[str]:
    """Problems of ``section``'s fields under ``rules``; ``prefix`` is its dotted name ("" for
    the root)."""
    problems = []
    for name, rule in rules.items():
        problem = rule.problem(f"{prefix}.{name}" if prefix else name, getattr(section, name))
        if problem:
            problems.append(problem)
    return problems
