"""PPO with GAE through run.py (Ray + ZeRO-3 LoRA actor and critic + vLLM + reward actors).

Two steps on the embedded model; the rollout dump carries each response's per-token values,
returns and advantages, from which the test recomputes GAE and the critic's first value loss
by hand. A second run resumes from the step-1 checkpoint and must repeat step 2 exactly, the
critic included.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _pipeline_run import is_volatile

from roll_ds.algorithms.advantages import gae_advantages, token_level_rewards
from roll_ds.algorithms.masks import masked_whiten
from roll_ds.config.compose import PROJECT_ROOT

pytestmark = pytest.mark.integration

CONFIG = "rlvr_ppo_gae_zero3"
GAMMA, LAM = 1.0, 0.95  # as in the yaml
# 2 prompts x 4 samples = 8 rows: 4 per rank of actor_train and critic, one micro batch each, so
# each role makes exactly one optimizer step per step and the critic's loss is computed with the
# weights that produced the rollout's values.
SMALL = [
    "max_steps=2",
    "save_steps=1",
    "eval_steps=0",
    "rollout_batch_size=2",
    "num_return_sequences_in_group=4",
    "actor_train.training_args.per_device_train_batch_size=4",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "critic.training_args.per_device_train_batch_size=4",
    "critic.training_args.gradient_accumulation_steps=1",
    "tracking.tensorboard=false",
    "tracking.dump_rollouts_every=1",
]
CRITIC_METRICS = (
    "critic/value_loss",
    "critic/vf_clipfrac",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/grad_norm",
    "critic/lr",
    "critic/optimizer_steps",
)


def run(out_dir: Path, *extra: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "run.py",
            "--config-name",
            CONFIG,
            f"output_dir={out_dir}",
            *SMALL,
            *extra,
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gae")
    run(out)
    return out / CONFIG


def test_critic_trains_on_gae_returns(straight: Path):
    rows = jsonl(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in CRITIC_METRICS:
            assert math.isfinite(row[key]), (row["step"], key)
        assert row["critic/optimizer_steps"] == 1.0 and row["optimizer_steps"] == 1.0
        assert row["critic/grad_norm"] > 0 and row["critic/lr"] > 0

    samples = [r for r in jsonl(straight / "rollouts.jsonl") if r["step"] == 2]
    assert len(samples) == 8
    raw_advantages, all_values, all_returns = [], [], []
    for sample in samples:
        values_BT = torch.tensor([sample["values"]])
        mask_BT = torch.ones_like(values_BT)
        rewards_BT = token_level_rewards(torch.tensor([sample["score"]]), mask_BT)
        adv_BT, returns_BT = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=GAMMA, lam=LAM)
        torch.testing.assert_close(torch.tensor([sample["returns"]]), returns_BT)
        raw_advantages.append(adv_BT[0])
        all_values.append(values_BT[0])
        all_returns.append(returns_BT[0])
    # The actor's advantages: GAE whitened over the batch (whiten_advantages: true).
    raw = torch.cat(raw_advantages)
    dumped = torch.tensor([a for s in samples for a in s["advantages"]])
    torch.testing.assert_close(dumped, masked_whiten(raw, torch.ones_like(raw)))

    # The critic's value loss on step 2: its fresh values still equal the rollout's (no update
    # since), so 0.5 * token-mean (V - R)^2 over the whole mini-batch (both ranks' rows: one
    # optimizer step), not a mean of per-rank means.
    v, r = torch.cat(all_values), torch.cat(all_returns)
    step2 = rows[1]
    expected = 0.5 * ((v - r) ** 2).mean().item()
    assert step2["critic/value_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert step2["critic/vf_clipfrac"] == 0.0
    assert step2["critic/values_mean"] == pytest.approx(torch.cat(all_values).mean().item())
    assert step2["critic/returns_mean"] == pytest.approx(torch.cat(all_returns).mean().item())
    assert (straight / "checkpoints" / "step_000002" / "critic" / "engine").is_dir()


def test_resume_restores_the_critic(straight: Path, tmp_path: Path):
    step1 = straight / "checkpoints" / "step_000001"
    run(tmp_path, f"resume_from_checkpoint={step1}")
    want = jsonl(straight / "metrics.jsonl")[1]
    (got,) = jsonl(tmp_path / CONFIG / "metrics.jsonl")
    assert got["step"] == 2
    stable = [k for k in want if not is_volatile(k)]
    assert set(stable) <= set(got)
    assert any(k.startswith("critic/") for k in stable)
    for key in stable:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


# The critic trains in full here (no LoRA), which puts the full-parameter critic on ZeRO-3 under
# test too. It starts where the straight run's LoRA critic starts (the same body, the same
# seeded head, an adapter that begins as a no-op), so its pass 1 repeats that run's step 1.
FULL_CRITIC = ("critic.model_args.lora_rank=null",)


# Slow: a third critic run (~70 s); CI keeps the passes of ppo_epochs > 1 for actor and critic in
# tests/unit/pipeline/test_passes.py (without a run).
@pytest.mark.slow
def test_two_ppo_epochs_reuse_the_rollout(straight: Path, tmp_path: Path):
    """``algorithm.ppo_epochs=2``: the same step-1 rollout, then two passes over it. Pass 1 is
    the straight run's training (on-policy, ratio 1); pass 2 sees the updated weights, so the
    step's averaged actor KL rises and the critic's pass-2 loss is below its pass-1 loss."""
    run(tmp_path, "max_steps=1", "save_steps=0", "algorithm.ppo_epochs=2", *FULL_CRITIC)
    (got,) = jsonl(tmp_path / CONFIG / "metrics.jsonl")
    want = jsonl(straight / "metrics.jsonl")[0]
    assert got["optimizer_steps"] == 2.0 and got["critic/optimizer_steps"] == 2.0
    for key in ("rollout/score", "rollout/response_length", "critic/values_mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    pass2_value_loss = 2 * got["critic/value_loss"] - want["critic/value_loss"]
    print(
        f"approx_kl {want['actor/approx_kl']:.3g} -> {got['actor/approx_kl']:.3g}; "
        f"value loss pass 1 {want['critic/value_loss']:.4g}, pass 2 {pass2_value_loss:.4g}"
    )
    assert got["actor/approx_kl"] > want["actor/approx_kl"]
    assert 0 <= pass2_value_loss < want["critic/value_loss"]
