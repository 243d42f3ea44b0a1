"""The ``code`` reward's pure parts (tests, fences, comparison, categories, options), its config
validation, and the synthetic code tasks' reference programs scoring 1 in the real sandbox."""

from __future__ import annotations

import re

import pytest

from examples.embedded_models.synthetic_code import TEMPLATES, CodeTaskSpec, code_problems
from roll_ds.config import load_config
from roll_ds.config.validate import ConfigError
from roll_ds.rewards.base import RewardSample
from roll_ds.rewards.code_reward import (
    CodeReward,
    CodeTest,
    categorize_test,
    category_counts,
    code_option_problems,
    extract_program,
    outputs_match,
    parse_tests,
)
from roll_ds.sandbox import SandboxResult


def test_parse_tests_accepts_both_shapes_and_names_what_is_wrong():
    io = parse_tests('{"tests": [{"input": "1\\n", "output": "2\\n"}, {"assert": "assert 1"}]}')
    assert io == [CodeTest("1\n", "2\n"), CodeTest(assertion="assert 1")]
    assert parse_tests([{"output": "x"}]) == [CodeTest("", "x")]
    for bad, match in (
        ("not json", "not JSON"),
        ("[]", "non-empty list"),
        ('{"cases": []}', "non-empty list"),
        ('[{"input": "1"}]', "test 0"),
        ('[{"input": 1, "output": "1"}]', "'input' must be a string"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_tests(bad)


def test_extract_program_prefers_the_last_python_fence():
    text = "plan\n```\nnot this\n```\n```python\nfirst\n```\n```python\nprint(1)\n```\nbye"
    assert extract_program(text) == "print(1)\n"
    assert extract_program("```\nprint(2)\n```") == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"
    assert extract_program(None) == ""


def test_outputs_match_lines_and_exact():
    assert outputs_match("7  \n\n", "7\n")
    assert outputs_match("a\r\nb\n", "a\nb")
    assert not outputs_match("7\n8\n", "7\n")
    assert not outputs_match("7", "7\n", "exact")


def test_test_category():
    io, check = CodeTest("", "4\n"), CodeTest(assertion="assert f() == 4")
    assert categorize_test(io, SandboxResult("4\n", "", "ok"), "lines") == "passed"
    assert categorize_test(io, SandboxResult("5\n", "", "ok"), "lines") == "wrong_answer"
    assert categorize_test(check, SandboxResult("", "", "ok"), "lines") == "passed"
    failed = SandboxResult("", "Traceback ...\nAssertionError\n", "runtime_error")
    assert categorize_test(check, failed, "lines") == "wrong_answer"
    assert categorize_test(io, failed, "lines") == "runtime_error"
    assert categorize_test(io, SandboxResult("", "", "timeout"), "lines") == "timeout"


def test_category_counts_sum_over_samples():
    infos = [{"categories": {"passed": 2, "timeout": 1}}, {"categories": {"passed": 1}}, {}]
    assert category_counts(infos) == {"passed": 3, "timeout": 1}


def test_option_problems_name_the_field_and_the_fix():
    assert code_option_problems({}) == []
    problems = code_option_problems(
        {"scoring": "most", "network_isolation": "maybe", "num_workers": 0, "timeout_s": -1}
        | {"memory_mb": 8, "max_processes": True}
    )
    assert problems == [
        "scoring: 'most'; valid: fraction, all_or_nothing",
        "network_isolation: 'maybe'; valid: required, best_effort, off",
        "num_workers: 0; use an integer >= 1 (CPU cores to use)",
        "timeout_s: -1; use seconds in (0, 3600]",
        "memory_mb: 8; use an integer >= 64",
        "max_processes: True; use an integer >= 1",
    ]


def test_bad_code_options_fail_config_validation():
    overrides = [
        "rewards.code.reward_fns=[{name: code, scoring: most, workdir_mb: 0}]",
    ]
    with pytest.raises(ConfigError) as err:
        load_config("rlvr_code_zero3", overrides, check_files=False)
    text = str(err.value)
    assert "rewards.code.reward_fns[0] (code).scoring: 'most'; valid: fraction" in text
    assert "rewards.code.reward_fns[0] (code).workdir_mb: 0; use an integer >= 1" in text


def test_reference_programs_of_the_code_tasks_score_one():
    """One task per template: the shipped tests are what real Python prints (run sandboxed)."""
    by_template: dict[str, dict] = {}
    for problem in code_problems(CodeTaskSpec()):  # every task, also those no split uses
        template = re.sub(r"\b(\d+|[a-z])\b(?=[ .])", "K", problem["prompt"])  # drop constant
        by_template.setdefault(template, problem)
    samples = [
        RewardSample(f"```python\n{p['solution']}\n```", p["ground_truth"])
        for p in by_template.values()
    ]
    with CodeReward(num_workers=2, timeout_s=5.0) as fn:
        out = fn(samples)
    assert out.scores == [1.0] * len(samples), [i for i in out.infos if not i["correct"]]
    assert len(samples) == len(TEMPLATES)
