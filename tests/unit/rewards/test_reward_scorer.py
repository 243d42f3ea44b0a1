"""Registry, spec building, the weighted-sum combiner and RewardScorer metrics."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from roll_ds.rewards import (
    REWARD_FNS,
    FunctionReward,
    RewardFn,
    RewardScorer,
    build_reward_fn,
    validate_reward_specs,
)
from roll_ds.rewards.build import WeightedSumReward
from roll_ds.rewards.exact_match import ExactMatchReward
from roll_ds.rewards.format import FormatReward
from roll_ds.rewards.math_rule import MathRuleReward
from roll_ds.rewards.scorer import compute_metrics

SLOW_PY = r"\boxed{\int_0^1 e^{x^2} \sin(x^3) dx}"


class _Flaky(RewardFn):
    """Raises on responses containing "boom"; otherwise 1.0."""

    name = "test_flaky"

    def score_one(self, response, ground_truth, prompt):
        if "boom" in response:
            raise RuntimeError("exploded on " + response)
        return 1.0, {}


class _BrokenBatch(RewardFn):
    """Its whole batch call raises."""

    name = "test_broken_batch"

    def score_batch(self, samples):
        raise ValueError("batch failure")


for _cls in (_Flaky, _BrokenBatch):
    if _cls.name not in REWARD_FNS:
        REWARD_FNS.register(_cls.name)(_cls)


# -- registry and specs ------------------------------------------------------------------------


def test_registry_names_and_unknown_name_error():
    for name in ("math_rule", "format", "exact_match", "weighted_sum"):
        assert name in REWARD_FNS
    assert REWARD_FNS.get("math_rule") is MathRuleReward
    assert REWARD_FNS.get("format") is FormatReward
    with pytest.raises(ValueError, match=r"unknown reward function 'nope'; valid: .*exact_match"):
        REWARD_FNS.get("nope")
    with pytest.raises(ValueError, match=r"valid: .*math_rule"):
        build_reward_fn({"name": "nope"})


def test_importing_the_package_does_not_import_math_verify():
    code = (
        "import sys, roll_ds.rewards as r; "
        "r.validate_reward_specs([{'name': 'math_rule'}]); "
        "assert 'math_verify' not in sys.modules and 'sympy' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_from_specs():
    assert isinstance(build_reward_fn("exact_match"), ExactMatchReward)
    fmt = build_reward_fn({"name": "format", "preset": "boxed"})
    assert isinstance(fmt, FormatReward) and fmt.preset == "boxed"
    weighted = build_reward_fn({"name": "exact_match", "weight": 2.0})
    assert isinstance(weighted, WeightedSumReward) and weighted.weights == {"exact_match": 2.0}
    combo = build_reward_fn(
        [{"name": "exact_match"}, {"name": "format", "weight": 0.1, "preset": "bare_answer"}]
    )
    assert combo.weights == {"exact_match": 1.0, "format": 0.1}
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) presett; valid: .*preset"):
        build_reward_fn({"name": "format", "presett": "boxed"})
    with pytest.raises(ValueError, match="weight must be a finite number"):
        build_reward_fn({"name": "format", "preset": "boxed", "weight": "high"})
    with pytest.raises(ValueError, match="mapping with 'name'"):
        build_reward_fn({"preset": "boxed"})


def test_defaults_fill_only_accepted_parameters():
    fn = build_reward_fn(
        [{"name": "math_rule"}, {"name": "math_rule", "timeout_s": 1.0}, {"name": "exact_match"}],
        defaults={"timeout_s": 7.0},
    )
    (_, _, a), (_, _, b), (_, _, c) = fn.components
    assert (a.timeout_s, b.timeout_s) == (7.0, 1.0)
    assert not hasattr(c, "timeout_s")
    assert list(fn.weights) == ["math_rule", "math_rule#2", "exact_match"]


def test_validate_reward_specs():
    good = [
        {"name": "math_rule", "weight": 1.0},
        {"name": "format", "weight": 0.1, "preset": "boxed"},
    ]
    assert validate_reward_specs(good) == []
    problems = validate_reward_specs(
        [{"name": "math_rul"}, {"name": "format", "presett": "x"}, {"weight": 1}]
    )
    assert len(problems) == 3
    assert problems[0].startswith("reward_fns[0]: unknown reward function 'math_rul'; valid:")
    assert "presett" in problems[1]
    assert "reward_fns[2]" in problems[2]
    assert validate_reward_specs([]) == ["reward_fns: expected a non-empty list of reward specs"]


# -- combiner ----------------------------------------------------------------------------------


def test_weighted_sum_by_hand():
    fn = build_reward_fn(
        [
            {"name": "exact_match", "weight": 1.0},
            {"name": "format", "weight": 0.1, "preset": "bare_answer"},
            {"name": "format", "weight": -0.5, "pattern": r".*\s.*", "key": "has_space"},
        ]
    )
    out = fn([("olleh", "olleh"), ("olle h", "olleh"), ("dlrow", "olleh")])
    # exact, bare, has_space -> 1*exact + 0.1*bare - 0.5*space
    assert out.scores == pytest.approx([1.0 + 0.1, 0.0 + 0.0 - 0.5, 0.0 + 0.1])
    assert out.infos[0]["rewards"] == {"exact_match": 1.0, "format": 1.0, "has_space": 0.0}
    assert [i["correct"] for i in out.infos] == [True, False, False]
    assert [i["format_ok"] for i in out.infos] == [True, False, True]  # the first format fn's


def test_failing_reward_fn_is_counted_not_raised():
    fn = WeightedSumReward(
        [{"name": "test_flaky", "weight": 2.0}, {"name": "exact_match", "weight": 1.0}]
    )
    out = fn([("ok", "ok"), ("boom", "boom"), ("ok", "no")])
    assert out.scores == [3.0, 1.0, 2.0]  # flaky fails only "boom" (0), exact match still counts
    assert out.infos[1]["error"].startswith("test_flaky: RuntimeError: exploded on boom")
    assert out.infos[0]["error"] is None and out.infos[2]["error"] is None

    broken = WeightedSumReward(
        [(_BrokenBatch(incorrect_score=-1.0), 1.0), (FunctionReward(lambda r, g, p: 0.25), 4.0)]
    )
    out = broken([("a", "a"), ("b", "b")])
    assert out.scores == [-1.0 + 1.0, -1.0 + 1.0]
    assert all(i["error"] == "test_broken_batch: ValueError: batch failure" for i in out.infos)


# -- scorer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def math_scorer():
    scorer = RewardScorer(
        {
            "reward_fns": [
                {"name": "math_rule", "weight": 1.0},
                {"name": "format", "weight": 0.1, "preset": "boxed"},
            ],
            "timeout_s": 5.0,
            "tag_included": ["math"],  # other RewardConfig keys are ignored
            "world_size": 1,
        }
    )
    scorer.warmup()
    yield scorer
    scorer.close()


def test_scorer_scores_and_metrics_by_hand(math_scorer):
    rows = [
        {"id": "a", "domain": "math", "prompt": "5+7=", "ground_truth": "12"},
        {"id": "b", "domain": "math", "prompt": "1/2=", "ground_truth": "0.5"},
        {"id": "c", "domain": "math", "prompt": "2+2=", "ground_truth": "4"},
        {"id": "d", "domain": "math", "prompt": "9-1=", "ground_truth": "8"},
    ]
    responses = [r"So \boxed{12}.", r"\frac{1}{2}", r"\boxed{5}", "garbage"]
    out = math_scorer.score(rows, responses)
    # correct:  1, 1, 0, 0;  boxed: 1, 0, 1, 0
    expected = [1.1, 1.0, 0.1, 0.0]
    assert out["scores"] == pytest.approx(expected)
    m = out["metrics"]
    mean = sum(expected) / 4
    assert m["num_samples"] == 4
    assert m["score_mean"] == pytest.approx(mean)
    assert m["score_std"] == pytest.approx(math.sqrt(sum((s - mean) ** 2 for s in expected) / 4))
    assert (m["score_min"], m["score_max"]) == (pytest.approx(0.0), pytest.approx(1.1))
    assert m["accuracy"] == 0.5
    assert m["format_rate"] == 0.5
    assert (m["num_timeouts"], m["num_errors"]) == (0, 0)
    assert m["score_mean/math_rule"] == 0.5 and m["score_mean/format"] == 0.5
    assert m["time_s"] > 0
    assert len(out["infos"]) == 4 and out["infos"][0]["extracted"] == "12"


def test_scorer_counts_timeouts_and_errors():
    scorer = RewardScorer.from_specs(
        [{"name": "math_rule", "weight": 1.0}, {"name": "test_flaky", "weight": 0.5}],
        timeout_s=0.3,
    )
    with scorer:
        out = scorer.score(
            [{"ground_truth": "12"}, {"ground_truth": "3"}, {"ground_truth": "3"}],
            [SLOW_PY, "3", "boom 3"],
        )
    assert out["scores"] == [0.5, 1.5, 1.0]
    m = out["metrics"]
    assert (m["num_timeouts"], m["num_errors"]) == (1, 1)
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert "format_rate" not in m  # no format reward configured
    assert out["infos"][0]["timed_out"] is True


def test_scorer_input_checks_and_empty_batch():
    with RewardScorer({"reward_fns": [{"name": "exact_match"}]}) as scorer:
        with pytest.raises(ValueError, match="2 rows but 1 responses"):
            scorer.score([{"ground_truth": "a"}, {"ground_truth": "b"}], ["a"])
        out = scorer.score([], [])
        assert out["scores"] == [] and out["metrics"]["num_samples"] == 0
        out = scorer.score([{"ground_truth": "olleh", "prompt": "reverse hello"}], ["olleh"])
        assert out["scores"] == [1.0] and out["metrics"]["accuracy"] == 1.0
    with pytest.raises(ValueError, match="no reward_fns"):
        RewardScorer({"timeout_s": 1.0})


def test_scorer_accepts_pipeline_config_objects():
    from omegaconf import OmegaConf

    from roll_ds.config.schema import RewardConfig

    specs = [{"name": "exact_match", "weight": 1.0}, {"name": "format", "preset": "bare_answer"}]
    for config in (
        OmegaConf.create({"reward_fns": specs, "timeout_s": 2.0}),
        RewardConfig(tag_included=["reverse"], reward_fns=specs, timeout_s=2.0),
    ):
        with RewardScorer(config) as scorer:
            assert scorer.weights == {"exact_match": 1.0, "format": 1.0}
            assert scorer.timeout_s == 2.0
            assert scorer.score([{"ground_truth": "ba"}], ["ba"])["scores"] == [2.0]


def test_compute_metrics_without_optional_keys():
    m = compute_metrics([1.0, 3.0], [{}, {"timed_out": True, "error": "x"}])
    assert m == {
        "num_samples": 2,
        "num_timeouts": 1,
        "num_errors": 1,
        "score_mean": 2.0,
        "score_std": 1.0,
        "score_min": 1.0,
        "score_max": 3.0,
    }
