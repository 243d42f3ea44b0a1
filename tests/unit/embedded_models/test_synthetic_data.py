"""The synthetic task generator: determinism, disjoint splits, correct answers, shipped files."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace

import pytest

from examples.embedded_models.synthetic import (
    ALL_DOMAINS,
    DOMAINS,
    TaskSpec,
    file_name,
    generate_all,
    generate_domain,
    to_jsonl,
)
from examples.embedded_models.synthetic_code import CodeTaskSpec, reference_solutions, run_reference

REPO = os.path.join(os.path.dirname(__file__), "..", "..", "..")
DATA_DIR = os.path.join(REPO, "examples", "qwen_rlvr", "data")


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "make_task_data", os.path.join(REPO, "scripts", "make_task_data.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generation_is_deterministic():
    assert generate_all(TaskSpec()) == generate_all(TaskSpec())
    assert generate_all(TaskSpec(seed=1)) != generate_all(TaskSpec())


@pytest.mark.parametrize("domain", ALL_DOMAINS)
def test_splits_are_disjoint_sized_and_uniquely_named(domain):
    spec = TaskSpec() if domain != "code" else CodeTaskSpec()
    rows = generate_domain(domain, TaskSpec())
    assert len(rows["train"]) == spec.n_train and len(rows["eval"]) == spec.n_eval
    train = {r["prompt"] for r in rows["train"]}
    held_out = {r["prompt"] for r in rows["eval"]}
    assert len(train) == spec.n_train and len(held_out) == spec.n_eval
    assert not train & held_out
    ids = [r["id"] for split in rows.values() for r in split]
    assert len(set(ids)) == len(ids)
    assert all(r["domain"] == domain for split in rows.values() for r in split)


def test_growing_the_train_split_keeps_the_eval_rows():
    small = generate_domain("math", TaskSpec(n_train=100))
    large = generate_domain("math", TaskSpec(n_train=1000))
    assert small["eval"] == large["eval"]


def test_math_ground_truth_is_the_integer_result():
    for row in generate_domain("math", TaskSpec())["eval"]:
        expr = row["prompt"].removesuffix("=")
        op = "+" if "+" in expr else "-"
        a, b = (int(x) for x in expr.split(op))
        assert row["ground_truth"] == str(a + b if op == "+" else a - b)


def test_reverse_ground_truth_is_the_reversed_word():
    spec = TaskSpec()
    for row in generate_domain("reverse", spec)["eval"]:
        word = row["prompt"].removeprefix("reverse ").removesuffix("=")
        assert spec.min_letters <= len(word) <= spec.max_letters
        assert row["ground_truth"] == word[::-1]


def test_too_small_a_problem_space_fails_clearly():
    with pytest.raises(ValueError, match="too small"):
        generate_domain("math", replace(TaskSpec(), max_operand=3))
    with pytest.raises(ValueError, match="valid: math, reverse, code"):
        generate_domain("poetry", TaskSpec())


def test_shipped_files_match_the_generator():
    for (domain, split), rows in generate_all(TaskSpec()).items():
        with open(os.path.join(DATA_DIR, file_name(domain, split)), encoding="utf-8") as f:
            assert f.read() == to_jsonl(rows), "regenerate with scripts/make_task_data.py"
    assert _load_script().main(["--check"]) == 0


def test_make_task_data_writes_identical_bytes(tmp_path):
    script = _load_script()
    assert script.main(["--out", str(tmp_path)]) == 0
    for name in sorted(os.listdir(DATA_DIR)):
        if name.endswith(".jsonl"):
            with open(tmp_path / name, "rb") as a, open(os.path.join(DATA_DIR, name), "rb") as b:
                assert a.read() == b.read()
    total = sum(os.path.getsize(os.path.join(DATA_DIR, n)) for n in os.listdir(DATA_DIR))
    assert total < 400_000  # math + reverse ~294 kB, code ~54 kB


def test_code_tasks_are_stdin_stdout_tests_of_tiny_programs():
    rows = generate_domain("code", TaskSpec())
    solutions = reference_solutions(CodeTaskSpec())
    assert set(DOMAINS) == {"math", "reverse"}  # the embedded model's warm-up does not see code
    for row in rows["eval"] + rows["train"]:
        tests = json.loads(row["ground_truth"])
        assert len(tests) == CodeTaskSpec().tests_per_task
        assert len(row["prompt"].encode()) <= 96  # fits rlvr_code_zero3's prompt_length
        for test in tests:
            assert test["output"] == run_reference(solutions[row["prompt"]], test["input"])
    assert generate_domain("code", TaskSpec(seed=1)) != rows
