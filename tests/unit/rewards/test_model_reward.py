"""Model-based reward terms without a model: score transforms, mixing with rule terms, judge
verdict parsing and timeouts, and the config checks. The models are hand-written fakes at the
boundary (a text -> score function, a generating strategy); the real ones are exercised in
tests/integration/test_reward_model_role.py and test_judge_vllm.py."""

from __future__ import annotations

import math
import threading

import pytest

from roll_ds.config.schema import (
    JudgeConfig,
    JudgePattern,
    ModelArgs,
    RewardConfig,
    ScoreTransform,
    StrategyArgs,
)
from roll_ds.rewards.judge import (
    JudgeReward,
    StrategyJudge,
    check_judge,
    fill_template,
    parse_verdict,
)
from roll_ds.rewards.model_reward import ModelReward, check_model_reward, transform_score
from roll_ds.rewards.scorer import RewardScorer


def length_rm(prompts, responses):
    """A fake reward model: the response's length minus 2."""
    return [float(len(r)) - 2.0 for r in responses]


# --- transforms and the model term -----------------------------------------------------------


def test_transform_score_scale_shift_and_sigmoid():
    assert transform_score(3.0, ScoreTransform()) == 3.0
    assert transform_score(3.0, ScoreTransform(scale=2.0, shift=-1.0)) == 4.0
    assert transform_score(0.0, ScoreTransform(sigmoid=True)) == 0.5
    assert transform_score(2.0, ScoreTransform(sigmoid=True)) == pytest.approx(
        1 / (1 + math.exp(-2))
    )
    # no overflow at extreme raw scores
    assert transform_score(-1e6, ScoreTransform(sigmoid=True)) == 0.0
    assert transform_score(1e6, ScoreTransform(sigmoid=True)) == 1.0


def test_model_reward_transforms_and_keeps_raw_scores():
    fn = ModelReward(length_rm, ScoreTransform(scale=0.5, shift=1.0))
    out = fn([("abcd", "x", "1+1="), ("", "x", "1+1=")])
    assert out.scores == [1.5, -0.5]  # 0.5 * (2 + 1), 0.5 * (-2 + 1)
    assert [i["raw_score"] for i in out.infos] == [2.0, -2.0]


def test_model_reward_without_a_model_names_the_fix():
    with pytest.raises(ValueError, match="head"):
        ModelReward()


def test_failing_reward_model_fails_the_batch_not_the_worker():
    def broken(prompts, responses):
        raise RuntimeError("device lost")

    out = ModelReward(broken)([("a", "1"), ("b", "1")])
    assert out.scores == [0.0, 0.0]
    assert all("device lost" in i["error"] for i in out.infos)


def test_rule_and_model_terms_mix_with_weights():
    specs = [{"name": "exact_match", "weight": 0.5}, {"name": "model", "weight": 0.5}]
    scorer = RewardScorer(
        {"reward_fns": specs}, resources={"reward_model": length_rm, "score_transform": None}
    )
    rows = [{"prompt": "reverse ab=", "ground_truth": "ba"}] * 2
    result = scorer.score(rows, ["ba", "abcd"])
    # exact_match 1 / 0; model raw 0 / 2 (len - 2)
    assert result["scores"] == [0.5 * 1 + 0.5 * 0.0, 0.5 * 0 + 0.5 * 2.0]
    assert [i["correct"] for i in result["infos"]] == [True, False]  # from the rule
    assert result["metrics"]["score_mean/model"] == 1.0


def test_weight_zero_rule_reports_accuracy_without_moving_the_score():
    specs = [{"name": "model", "weight": 1.0}, {"name": "exact_match", "weight": 0.0}]
    scorer = RewardScorer({"reward_fns": specs}, resources={"reward_model": length_rm})
    result = scorer.score([{"prompt": "p", "ground_truth": "ab"}] * 2, ["ab", "abc"])
    assert result["scores"] == [0.0, 1.0]  # the model's alone
    assert result["metrics"]["accuracy"] == 0.5  # the rule's verdict


def test_rule_only_scorer_ignores_unused_resources():
    scorer = RewardScorer(
        {"reward_fns": [{"name": "exact_match"}]}, resources={"reward_model": length_rm}
    )
    assert scorer.score([{"prompt": "p", "ground_truth": "a"}], ["a"])["scores"] == [1.0]


# --- the judge ---------------------------------------------------------------------------------


def test_parse_verdict_keywords_in_order_and_numbers():
    default = JudgeConfig(template="{question}{response}").patterns
    assert parse_verdict("The answer is correct.", default) == 1.0
    assert parse_verdict("That is INCORRECT", default) == 0.0  # not read as "correct"
    assert parse_verdict("no idea", default) is None
    numeric = [JudgePattern(regex=r"Score:\s*([0-9.]+)")]
    assert parse_verdict("Score: 0.75 because", numeric) == 0.75
    assert parse_verdict("Score: none", numeric) is None


def test_fill_template_with_reference():
    text = fill_template("Q:{question} A:{response} R:{reference}", "1+1=", "2", ["2", "two"])
    assert text == "Q:1+1= A:2 R:2"


class FakeTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeGenerator:
    """Echoes a verdict per prompt: 'correct' when the prompt holds 'ok', else gibberish;
    waits on ``gate`` first when given one."""

    def __init__(self, gate=None):
        self.gate = gate

    def generate(self, prompts, **kwargs):
        if self.gate is not None:
            self.gate.wait(5)
        texts = ["correct" if "ok" in "".join(map(chr, p)) else "???" for p in prompts]
        return {"response_ids": [[ord(c) for c in t] for t in texts]}


def fake_judge(gate=None, timeout_s=5.0):
    cfg = JudgeConfig(template="{question} {response}", timeout_s=timeout_s)
    return StrategyJudge(FakeGenerator(gate), FakeTokenizer(), cfg, "raw")


def test_judge_counts_unparsed_verdicts_and_keeps_scoring():
    with RewardScorer(
        {"reward_fns": [{"name": "judge"}]}, resources={"judge": fake_judge()}
    ) as scorer:
        result = scorer.score([{"prompt": "q", "ground_truth": "a"}] * 3, ["ok", "bad", "ok"])
    assert result["scores"] == [1.0, 0.0, 1.0]
    assert result["metrics"]["judge_unparsed"] == 1
    assert result["metrics"]["num_errors"] == 1
    assert "unparsed verdict" in result["infos"][1]["error"]


def test_judge_timeout_scores_unparsed_and_is_counted():
    gate = threading.Event()
    fn = JudgeReward(fake_judge(gate, timeout_s=0.2))
    out = fn([("ok", "a", "q")])
    assert out.scores == [0.0] and out.infos[0]["timed_out"]
    gate.set()  # the engine finishes the stuck batch; the next one is served normally
    assert fn([("ok", "a", "q")]).scores == [1.0]
    fn.close()


# --- validation --------------------------------------------------------------------------------


def rm_role(**kw):
    base = dict(
        tag_included=["math"],
        reward_fns=[{"name": "model", "weight": 1.0}],
        head="sequence_classification",
        model_args=ModelArgs(model_name_or_path="embedded:tiny-rm"),
        strategy_args=StrategyArgs(strategy_name="hf_infer"),
    )
    return RewardConfig(**{**base, **kw})


def test_valid_model_roles_and_rule_roles_pass():
    assert check_model_reward("rewards.math", rm_role()) == []
    assert check_model_reward("rewards.math", rm_role(head="value")) == []
    rule = RewardConfig(tag_included=["math"], reward_fns=[{"name": "math_rule"}])
    assert check_model_reward("rewards.math", rule) == []


@pytest.mark.parametrize(
    "kw, field, fix",
    [
        ({"head": "regression"}, "rewards.math.head", "sequence_classification"),
        (
            {"strategy_args": StrategyArgs(strategy_name="vllm")},
            "rewards.math.strategy_args.strategy_name",
            "deepspeed_infer, hf_infer",
        ),
        (
            {"model_args": ModelArgs()},
            "rewards.math.model_args.model_name_or_path",
            "embedded:tiny-rm",
        ),
        ({"reward_fns": [{"name": "math_rule"}]}, "rewards.math.reward_fns", "name: model"),
        ({"head": None}, "rewards.math.strategy_args.strategy_name", "neither a head"),
        ({"input_template": "jinja"}, "rewards.math.input_template", "raw, chat"),
    ],
)
def test_bad_model_role_names_field_and_fix(kw, field, fix):
    problems = check_model_reward("rewards.math", rm_role(**kw))
    assert any(p.startswith(field) and fix in p for p in problems), problems


def test_model_term_without_head_is_reported():
    role = RewardConfig(tag_included=["math"], reward_fns=[{"name": "model"}])
    problems = check_model_reward("rewards.math", role)
    assert any("term 'model' needs the role's head" in p for p in problems), problems


def test_judge_config_checks():
    ok = JudgeConfig(template="Q: {question} A: {response} ({reference})")
    assert check_judge("j", ok) == []
    problems = check_judge("j", JudgeConfig(template="Q: {question} {answer}"))
    assert any("{answer}" in p for p in problems)
    assert any("needs {response}" in p for p in problems)
    bad = JudgeConfig(
        template="{question}{response}",
        patterns=[JudgePattern(regex="(unclosed"), JudgePattern(regex="score", score=None)],
    )
    problems = check_judge("j", bad)
    assert any(p.startswith("j.patterns[0].regex") for p in problems)
    assert any(p.startswith("j.patterns[1]") and "group" in p for p in problems)
    assert check_judge("j", JudgeConfig(template="{question"))[0].startswith("j.template")


def test_judge_role_needs_a_generating_strategy():
    role = RewardConfig(
        tag_included=["qa"],
        reward_fns=[{"name": "judge"}],
        judge=JudgeConfig(template="{question}{response}"),
        model_args=ModelArgs(model_name_or_path="embedded:tiny-qwen2"),
        strategy_args=StrategyArgs(strategy_name="deepspeed_infer"),
    )
    problems = check_model_reward("rewards.qa", role)
    assert any("needs one of hf_infer, vllm" in p for p in problems), problems
    ok = RewardConfig(**{**role.__dict__, "strategy_args": StrategyArgs(strategy_name="vllm")})
    assert check_model_reward("rewards.qa", ok) == []


def test_validate_reports_model_role_problems_in_one_error():
    from roll_ds.config import load_config
    from roll_ds.config.validate import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(
            "rlvr_lora_zero3_rm",
            overrides=[
                "rewards.math.strategy_args.strategy_name=vllm",
                "rewards.reverse.head=null",
            ],
            check_files=False,
        )
    text = str(info.value)
    assert "rewards.math.strategy_args.strategy_name" in text
    assert "rewards.reverse.reward_fns: term 'model' needs the role's head" in text
