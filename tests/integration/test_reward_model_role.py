"""The discriminative reward-model role with real components: the embedded reward model
(``embedded:tiny-rm``) served by hf_infer and deepspeed_infer, and in the real pipeline (Ray
actors, ZeRO-3 LoRA trainer, vLLM rollouts) for two steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from roll_ds.config.compose import PROJECT_ROOT  # noqa: E402
from roll_ds.models.reward_model import forward_scores, left_pad  # noqa: E402
from roll_ds.rewards.model_reward import StrategyTextScorer  # noqa: E402
from strategies.hf_infer import HfInferStrategy  # noqa: E402

pytestmark = pytest.mark.integration

PROMPTS = ["12+3=", "reverse abcde=", "7-9=", "reverse xyz="]
RESPONSES = ["15", "edcb", "-2", "zyx"]


@pytest.fixture(scope="module")
def rm_strategy():
    strategy = HfInferStrategy(
        model_path="embedded:tiny-rm", head="sequence_classification", infer_batch_size=3
    )
    strategy.initialize()
    return strategy


def test_batched_left_padded_scores_equal_one_by_one(rm_strategy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm_strategy.model_path)
    batched = StrategyTextScorer(rm_strategy, tokenizer)(PROMPTS, RESPONSES)
    single = []
    for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
        ids = tokenizer(prompt + response, add_special_tokens=False)["input_ids"]
        ids_BT, mask_BT = left_pad([ids], tokenizer.pad_token_id)
        with torch.no_grad():
            single.append(
                float(forward_scores(rm_strategy.model, "sequence_classification", ids_BT, mask_BT))
            )
    assert batched == pytest.approx(single, abs=1e-5)


def test_embedded_rm_prefers_right_answers_on_average(rm_strategy):
    """The shipped model's recorded held-out accuracy, re-measured on a few pairs here: right
    answers outscore the typical flaws (sign slip, reversal one short) more often than not."""
    from transformers import AutoTokenizer

    from examples.embedded_models.synthetic import TaskSpec, flawed_answer, generate_domain

    tokenizer = AutoTokenizer.from_pretrained(rm_strategy.model_path)
    scorer = StrategyTextScorer(rm_strategy, tokenizer)
    rows = []
    for domain in ("math", "reverse"):
        rows += [
            r for r in generate_domain(domain, TaskSpec())["eval"][:40] if r["ground_truth"] != "0"
        ]
    prompts = [r["prompt"] for r in rows]
    right = scorer(prompts, [r["ground_truth"] for r in rows])
    wrong = scorer(prompts, [flawed_answer(r["domain"], r["ground_truth"]) for r in rows])
    wins = sum(r > w for r, w in zip(right, wrong, strict=True)) / len(rows)
    recorded = json.loads(
        (PROJECT_ROOT / "roll_ds/models/embedded_tiny_rm/roll_ds_recipe.json").read_text()
    )
    print(
        f"\nright > flawed on {wins:.2f} of {len(rows)} held-out prompts; "
        f"recorded: {recorded['held_out']['overall']}"
    )
    assert wins > 0.5


def test_reward_model_role_in_the_pipeline(tmp_path):
    """Two steps of rlvr_lora_zero3_rm: math's reward model on hf_infer, reverse's on
    deepspeed_infer (ZeRO-3); rewards are sigmoid scores, eval accuracy is the rule's."""
    cmd = [
        sys.executable,
        "run.py",
        "--config-name",
        "rlvr_lora_zero3_rm",
        f"output_dir={tmp_path}",
        "max_steps=2",
        "save_steps=0",
        "eval_steps=2",
        "rollout_batch_size=4",
        "num_return_sequences_in_group=4",
        "actor_train.training_args.per_device_train_batch_size=8",
        "actor_train.training_args.gradient_accumulation_steps=1",
        "validation.max_prompts=16",
        "tracking.tensorboard=false",
        "export.at_end=false",
        "rewards.reverse.strategy_args.strategy_name=deepspeed_infer",
        "rewards.reverse.strategy_args.strategy_config=${deepspeed_zero3}",
    ]
    proc = subprocess.run(
        cmd,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    path = tmp_path / "rlvr_lora_zero3_rm" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in rows if "rollout/score" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        for domain in ("math", "reverse"):
            assert 0.0 < row[f"rollout/{domain}/score"] < 1.0  # a sigmoid, not a 0/1 rule
            assert f"rollout/{domain}/accuracy" in row  # the weight-0 rule's verdict
        assert row["rollout/errors"] == 0 and row["rollout/timeouts"] == 0
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
