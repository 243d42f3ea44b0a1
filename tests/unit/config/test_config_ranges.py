"""Every field's range (``roll_ds/config/ranges.py``): a value out of range is one problem naming
the field, the bound and what the bound means."""

import pytest
from _config_problems import only

from roll_ds.config import load_config
from roll_ds.config.checks.fields import role_field_problems
from roll_ds.config.schema import GeneratingArgs, JudgeConfig, RewardConfig

SEED_NOTE = "vLLM's seed range; -1 does not mean random here, pick a seed"


def test_zero_micro_batch_is_one_clear_problem():
    # Used to end in a ZeroDivisionError traceback in the batch arithmetic.
    msg = only("actor_train.training_args.per_device_train_batch_size=0")
    assert msg == "actor_train.training_args.per_device_train_batch_size: must be >= 1, got 0"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # pipeline
        ("max_steps=0", "max_steps: must be >= 1, got 0"),
        ("prompt_length=0", "prompt_length: must be >= 1, got 0"),
        ("save_steps=-1", "save_steps: must be >= 0 (0: no periodic checkpoints), got -1"),
        ("keep_last=-1", "keep_last: must be >= 0 (0: keep every checkpoint), got -1"),
        ("logging_steps=-1", "logging_steps: must be >= 0 (0 or 1: every step), got -1"),
        ("eval_steps=-2", "eval_steps: must be >= 0 (0: no periodic evaluation), got -2"),
        # seeds: vLLM refuses one outside 0..2**32 - 1, but only once the actors run
        ("seed=-1", f"seed: must be in [0, 4294967295] ({SEED_NOTE}), got -1"),
        ("seed=4294967296", f"seed: must be in [0, 4294967295] ({SEED_NOTE}), got 4294967296"),
        (
            "actor_infer.generating_args.seed=-1",
            "actor_infer.generating_args.seed: must be in [0, 4294967295] "
            f"({SEED_NOTE}; or null: unseeded, unless the caller seeds), got -1",
        ),
        (
            "validation.generating_args.seed=4294967296",
            "validation.generating_args.seed: must be in [0, 4294967295] "
            f"({SEED_NOTE}; or null: unseeded, unless the caller seeds), got 4294967296",
        ),
        # training_args
        (
            "actor_train.training_args.learning_rate=-1e-5",
            "actor_train.training_args.learning_rate: must be > 0, got -1e-05",
        ),
        (
            "actor_train.training_args.weight_decay=-0.1",
            "actor_train.training_args.weight_decay: must be >= 0, got -0.1",
        ),
        (
            "actor_train.training_args.adam_beta2=1.0",
            "actor_train.training_args.adam_beta2: must be in [0, 1), got 1.0",
        ),
        (
            "actor_train.training_args.adam_epsilon=0",
            "actor_train.training_args.adam_epsilon: must be > 0, got 0.0",
        ),
        (
            "actor_train.training_args.gradient_accumulation_steps=0",
            "actor_train.training_args.gradient_accumulation_steps: must be >= 1, got 0",
        ),
        (
            "actor_train.training_args.warmup_steps=-1",
            "actor_train.training_args.warmup_steps: must be >= 0, got -1",
        ),
        (
            "actor_train.training_args.lr_scheduler_type=step",
            "actor_train.training_args.lr_scheduler_type: 'step' is not one of constant, linear, "
            "cosine",
        ),
        (
            "actor_train.training_args.max_grad_norm=-1",
            "actor_train.training_args.max_grad_norm: must be >= 0 (0: no gradient clipping), "
            "got -1.0",
        ),
        # generating_args (the rollout role's and evaluation's)
        (
            "actor_infer.generating_args.temperature=-0.5",
            "actor_infer.generating_args.temperature: must be >= 0 (0: greedy), got -0.5",
        ),
        (
            "actor_infer.generating_args.top_p=0",
            "actor_infer.generating_args.top_p: must be in (0, 1], got 0.0",
        ),
        (
            "actor_infer.generating_args.top_k=-2",
            "actor_infer.generating_args.top_k: must be >= -1 (-1 or 0: off), got -2",
        ),
        (
            "actor_infer.generating_args.max_new_tokens=0",
            "actor_infer.generating_args.max_new_tokens: must be >= 1 (or null: response_length), "
            "got 0",
        ),
        (
            "validation.generating_args.top_p=1.5",
            "validation.generating_args.top_p: must be in (0, 1], got 1.5",
        ),
        # model_args
        (
            "actor_train.model_args.lora_alpha=0",
            "actor_train.model_args.lora_alpha: must be > 0 (or null: 2 x lora_rank), got 0",
        ),
        (
            "actor_train.model_args.lora_dropout=1.0",
            "actor_train.model_args.lora_dropout: must be in [0, 1), got 1.0",
        ),
        (
            "actor_train.model_args.attn_implementation=flash",
            "actor_train.model_args.attn_implementation: 'flash' is not one of null, eager, sdpa, "
            "fa2, flash_attention_2",
        ),
        # algorithm
        ("algorithm.clip_low=1.0", "algorithm.clip_low: must be in [0, 1), got 1.0"),
        ("algorithm.clip_high=-0.1", "algorithm.clip_high: must be >= 0, got -0.1"),
        (
            "algorithm.dual_clip=1.0",
            "algorithm.dual_clip: must be > 1 (or null: no dual clip), got 1.0",
        ),
        ("algorithm.ratio_level=seq", "algorithm.ratio_level: 'seq' is not one of token, sequence"),
        ("algorithm.seq_clip_low=1", "algorithm.seq_clip_low: must be in [0, 1), got 1.0"),
        ("algorithm.seq_clip_high=-1e-4", "algorithm.seq_clip_high: must be >= 0, got -0.0001"),
        (
            "algorithm.loss_agg_mode=mean",
            "algorithm.loss_agg_mode: 'mean' is not one of seq-mean-token-mean, "
            "seq-mean-token-sum, seq-mean-token-sum-norm, token-mean",
        ),
        ("algorithm.kl_estimator=k4", "algorithm.kl_estimator: 'k4' is not one of k1, k2, k3"),
        (
            "algorithm.kl_coef=-0.1",
            "algorithm.kl_coef: must be >= 0 (0: no KL to the reference), got -0.1",
        ),
        (
            "algorithm.kl_coef=nan",
            "algorithm.kl_coef: must be >= 0 (0: no KL to the reference), got nan",
        ),
        (
            "algorithm.entropy_coef=-0.01",
            "algorithm.entropy_coef: must be >= 0 (0: no entropy bonus), got -0.01",
        ),
        (
            "algorithm.max_resample_rounds=0",
            "algorithm.max_resample_rounds: must be >= 1 (1: no resampling), got 0",
        ),
        (
            "algorithm.tis_cap=0",
            "algorithm.tis_cap: must be > 0 (or null: 2.0 with token_tis, seq_tis or "
            "async_generation; else no correction), got 0.0",
        ),
        (
            "algorithm.overlong_buffer_len=-1",
            "algorithm.overlong_buffer_len: must be >= 0 (0: no overlong penalty), got -1",
        ),
        (
            "algorithm.overlong_penalty_factor=-1",
            "algorithm.overlong_penalty_factor: must be >= 0, got -1.0",
        ),
        # weight_sync, rewards, tracking, validation, data, ray
        ("weight_sync.bucket_bytes=0", "weight_sync.bucket_bytes: must be >= 1, got 0"),
        ("weight_sync.timeout_s=0", "weight_sync.timeout_s: must be > 0, got 0.0"),
        ("weight_sync.parity_probe_size=0", "weight_sync.parity_probe_size: must be >= 1, got 0"),
        (
            "weight_sync.parity_max_abs_diff=0",
            "weight_sync.parity_max_abs_diff: must be > 0 (or null: the default of the rollout "
            "dtype), got 0.0",
        ),
        ("rewards.math.timeout_s=0", "rewards.math.timeout_s: must be > 0, got 0.0"),
        (
            "tracking.dump_rollouts_every=-1",
            "tracking.dump_rollouts_every: must be >= 0 (0: never), got -1",
        ),
        (
            "validation.max_prompts=0",
            "validation.max_prompts: must be >= 1 (or null: every held-out row), got 0",
        ),
        (
            "actor_train.data_args.max_samples=0",
            "actor_train.data_args.max_samples: must be >= 1 (or null: every row), got 0",
        ),
        (
            "actor_train.data_args.template=jinja",
            "actor_train.data_args.template: 'jinja' is not one of raw, chat",
        ),
        ("ray.num_cpus=0", "ray.num_cpus: must be >= 1 (or null: all CPUs of the machine), got 0"),
    ],
)
def test_field_ranges(override, expected):
    assert only(override) == expected


def test_name_lists_match_their_registries():
    from roll_ds.algorithms.aggregation import AGG_MODES
    from roll_ds.algorithms.corrections import CORRECTIONS
    from roll_ds.algorithms.kl import KL_ESTIMATORS
    from roll_ds.algorithms.policy_loss import RATIO_LEVELS
    from roll_ds.config import ranges
    from strategies._common import SCHEDULES

    assert sorted(ranges.LOSS_AGG_MODES) == AGG_MODES.names()
    assert sorted(ranges.KL_ESTIMATORS) == KL_ESTIMATORS.names()
    assert ranges.RATIO_LEVELS == RATIO_LEVELS
    assert list(ranges.ROLLOUT_CORRECTIONS) == CORRECTIONS.names()
    assert ranges.LR_SCHEDULES == SCHEDULES


def test_training_args_of_a_role_that_does_not_train_are_not_checked():
    load_config(
        "rlvr_full_zero3",
        ["reference.training_args.learning_rate=-1", "actor_infer.training_args.adam_beta1=2"],
        check_files=False,
    )


def test_seeds_at_the_ends_of_the_range_validate():
    for seed in (0, 2**32 - 1):
        cfg = load_config(
            "rlvr_lora_zero3",
            [f"seed={seed}", f"actor_infer.generating_args.seed={seed}"],
            check_files=False,
        )
        assert cfg.seed == seed


def test_a_judge_seed_is_checked_like_the_rollout_engine_one():
    judge = RewardConfig(
        judge=JudgeConfig(template="{question} {response}"),
        generating_args=GeneratingArgs(seed=-1),
    )
    assert role_field_problems("judge", judge) == [
        "judge.generating_args.seed: must be in [0, 4294967295] "
        f"({SEED_NOTE}; or null: unseeded, unless the caller seeds), got -1"
    ]
    # a reward role that generates nothing does not read its generating_args
    assert role_field_problems("rule", RewardConfig(generating_args=GeneratingArgs(seed=-1))) == []


@pytest.mark.parametrize("bound", ["0.001", "9.9"])
def test_a_call_timeout_no_call_can_meet(bound):
    assert only(f"fault_tolerance.call_timeout_s={bound}") == (
        f"fault_tolerance.call_timeout_s: must be >= 10 (seconds; below it no train step or "
        f"scoring call can finish and every call would time out into a replacement or "
        f"restart), got {bound}"
    )
    load_config("rlvr_lora_zero3", ["fault_tolerance.call_timeout_s=10"], check_files=False)
