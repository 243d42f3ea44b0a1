"""The TRL comparison benchmark mirrors our config: batch mapping, reward, prompts, step folding.

Only the pure helpers are tested, so TRL need not be installed.
"""

import pytest

from benchmarks.rlvr_step import PHASES
from benchmarks.trl_grpo_step import (
    fold,
    optimizer_steps_per_rollout,
    phase_row,
    planned_prompts,
    task_reward,
    trl_settings,
)
from roll_ds.config import compose_config, load_config, to_schema


@pytest.fixture(scope="module")
def cfg():
    return load_config("rlvr_lora_zero3")


def test_settings_match_our_batches(cfg):
    s = trl_settings(cfg)
    samples = cfg.rollout_batch_size * cfg.num_return_sequences_in_group  # 16 x 8
    targs = cfg.actor_train.training_args
    ours_per_optimizer_step = (
        targs.per_device_train_batch_size * targs.gradient_accumulation_steps * 2
    )
    assert s["per_device_train_batch_size"] * s["steps_per_generation"] == samples
    assert s["per_device_train_batch_size"] * s["gradient_accumulation_steps"] == (
        ours_per_optimizer_step
    )
    assert optimizer_steps_per_rollout(s) == samples // ours_per_optimizer_step == 2
    assert s["num_generations"] == cfg.num_return_sequences_in_group
    assert s["max_completion_length"] == cfg.response_length
    assert (s["epsilon"], s["epsilon_high"], s["beta"]) == (0.2, 0.28, 0.0)
    assert s["loss_type"] == "dapo" and s["scale_rewards"] == "group"


def test_settings_reject_what_trl_cannot_mirror():
    overrides = ["rollout_batch_size=3", "algorithm.adv_estimator=rloo"]
    cfg = to_schema(compose_config("rlvr_lora_zero3", overrides))  # unvalidated on purpose
    with pytest.raises(ValueError, match=r"adv_estimator.*not a whole number"):
        trl_settings(cfg)


def test_reward_is_answers_match():
    scores = task_reward(
        completions=[" 55", "55.0", "5 5", "dcba", "abcd"],
        ground_truth=["55", "55", "55", "dcba", "dcba"],
        domain=["math", "math", "math", "reverse", "reverse"],
        prompts=["unused"] * 5,
    )
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_planned_prompts_are_our_sampler_batches(cfg):
    batches = planned_prompts(cfg, 2)
    assert [len(b) for b in batches] == [cfg.rollout_batch_size] * 2
    assert planned_prompts(cfg, 2) == batches  # deterministic
    assert {r["domain"] for b in batches for r in b} == {"math", "reverse"}


def test_fold_and_phase_row():
    assert fold([1.0, 2.0, 3.0, 4.0], 2) == [3.0, 7.0]
    with pytest.raises(ValueError):
        fold([1.0, 2.0, 3.0], 2)
    row = phase_row(10.0, {"generate": 2.0, "reward": 0.5, "logprobs": 1.0, "prepare": 4.0})
    assert set(row) == set(PHASES)
    assert row["rollout"] == 2.5 and row["advantage"] == 0.5 and row["train"] == 6.0
    assert sum(row[p] for p in ("sync", "rollout", "logprobs", "advantage", "train")) == 10.0
