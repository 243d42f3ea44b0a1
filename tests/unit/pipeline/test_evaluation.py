"""Evaluation: pass@k and the other eval numbers against hand-computed values, the loop that
produces them (with a fake rollout engine and reward at the boundary), the config checks, and
what ``python -m roll_ds.evaluate`` accepts as ``checkpoint=``."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from roll_ds.config import ConfigError, load_config
from roll_ds.distributed.batch import Batch, object_array
from roll_ds.evaluate import (
    CheckpointArgError,
    checkpoint_kind,
    eval_config,
    length_rows,
    main,
    result_name,
    split_checkpoint_arg,
    table_rows,
)
from roll_ds.pipeline.eval_metrics import (
    default_pass_ks,
    eval_metric_names,
    length_metrics,
    pass_at_k,
    percentile,
    sampled_metrics,
)
from roll_ds.pipeline.evaluation import evaluate_policy
from roll_ds.pipeline.rollout import domain_metrics

# --- pass@k ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (5, 2, 1, 2 / 5),  # pass@1 is the fraction correct
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (5, 2, 4, 1.0),  # only 3 wrong samples: any 4 hold a right one
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_stays_exact_and_bad_arguments_fail():
    # 1 - C(150, 100)/C(200, 100) by the product form of Chen et al.
    product = 1 - np.prod(1.0 - 100 / np.arange(151, 201))
    assert pass_at_k(200, 50, 100) == pytest.approx(product, rel=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_default_pass_ks():
    assert default_pass_ks(0) == []
    assert default_pass_ks(1) == [1]
    assert default_pass_ks(8) == [1, 2, 4, 8]
    assert default_pass_ks(6) == [1, 2, 4, 6]


# --- mean@k, pass@k per domain; lengths -------------------------------------------------------


def _sampled_rows():
    """p0 (math): 1 of 4 right; p1 (math): 4 of 4; p2 (reverse): 0 of 4."""
    prompts, domains, correct = [], [], []
    for prompt, domain, right in (("p0", "math", 1), ("p1", "math", 4), ("p2", "reverse", 0)):
        prompts += [prompt] * 4
        domains += [domain] * 4
        correct += [True] * right + [False] * (4 - right)
    return prompts, domains, correct


def test_sampled_metrics_hand_computed():
    got = sampled_metrics(*_sampled_rows(), ks=[1, 2, 4])
    p0_pass2 = 1 - 3 / 6  # 1 - C(3,2)/C(4,2)
    want = {
        "eval/mean@4": (0.25 + 1 + 0) / 3,
        "eval/pass@1": (0.25 + 1 + 0) / 3,
        "eval/pass@2": (p0_pass2 + 1 + 0) / 3,
        "eval/pass@4": 2 / 3,
        "eval/math/mean@4": 0.625,
        "eval/math/pass@1": 0.625,
        "eval/math/pass@2": (p0_pass2 + 1) / 2,
        "eval/math/pass@4": 1.0,
        "eval/reverse/mean@4": 0.0,
        "eval/reverse/pass@1": 0.0,
        "eval/reverse/pass@2": 0.0,
        "eval/reverse/pass@4": 0.0,
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


def test_sampled_metrics_skip_samples_without_correctness_and_ks_above_n():
    prompts, domains, correct = _sampled_rows()
    correct[0] = None  # p0: 3 samples left, none right
    prompts += ["p3"] * 2
    domains += ["code"] * 2
    correct += [None, None]  # a domain whose reward reports no correctness
    got = sampled_metrics(prompts, domains, correct, ks=[1, 3, 4])
    assert "eval/pass@4" not in got  # the fewest samples any prompt has is 3
    assert got["eval/mean@3"] == pytest.approx((0 + 1 + 0) / 3)
    assert got["eval/math/pass@3"] == pytest.approx(0.5)
    assert not any("/code/" in k for k in got)
    assert sampled_metrics(["p"], ["math"], [None], ks=[1]) == {}


def test_length_metrics_hand_computed():
    lengths = [4, 1, 10, 3, 2]
    finish = ["stop", "stop", "length", "stop", "length"]
    got = length_metrics(lengths, finish)
    assert got == {
        "eval/response_length/mean": 4.0,
        "eval/response_length/p50": 3.0,
        "eval/response_length/p90": pytest.approx(7.6),  # 4 + (10 - 4) * 0.6
        "eval/response_length/max": 10.0,
        "eval/truncated_fraction": 0.4,
    }
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == np.percentile([1, 2, 3, 4], 50)
    assert percentile([7.0], 90) == 7.0
    assert length_metrics([], []) == {}


# --- the evaluation loop, fake rollout engine and reward ---------------------------------------

ROWS = [
    {"prompt_ids": [1, 2], "prompt": "1+1=", "ground_truth": "2", "domain": "math", "id": "a"},
    {"prompt_ids": [3], "prompt": "ab", "ground_truth": "ba", "domain": "reverse", "id": "b"},
    {"prompt_ids": [4, 5], "prompt": "2+2=", "ground_truth": "4", "domain": "math", "id": "c"},
]


class _Done:
    def __init__(self, value):
        self.value = value

    def get(self, timeout_s=None):
        return self.value


class FakeEngines:
    """The rollout role (the Ray boundary): ``n`` responses per context, grouped by context.
    Greedy answers row 0 and 1 right; samples: sample j of row r is right when j < r + 1."""

    name = "actor_infer"

    def __init__(self):
        self.calls = []

    def submit(self, method, batch, *, seed, n, temperature, **sampling):
        assert method == "generate"
        limit = batch["max_new_tokens"][0]
        self.calls.append(
            dict(seed=seed, n=n, temperature=temperature, max_new_tokens=limit, **sampling)
        )
        rows, responses = [], []
        for r in batch["row"]:
            truth = ROWS[r]["ground_truth"]
            for j in range(n):
                right = r < 2 if n == 1 else j < r + 1
                rows.append(r)
                responses.append([ord(ch) for ch in (truth if right else "x" * (j + 1))])
        return _Done(
            Batch(
                non_tensors={
                    "row": rows,
                    "response_ids": responses,
                    "rollout_logprobs": [[0.0] * len(r) for r in responses],
                    "finish_reason": ["length" if len(r) >= limit else "stop" for r in responses],
                }
            )
        )


class FakeTokenizer:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeReward:
    """A reward role: right when the response equals the ground truth."""

    def submit(self, method, part):
        assert method == "score"
        right = [t == g for t, g in zip(part["response_text"], part["ground_truth"], strict=True)]
        return _Done(
            Batch(
                {"scores": torch.tensor(right, dtype=torch.float32)},
                {"reward_info": object_array([{"correct": ok} for ok in right])},
            )
        )


def _cfg(**validation):
    cfg = load_config("rlvr_lora_zero3", check_files=False)
    return replace(cfg, validation=replace(cfg.validation, **validation))


def _phase(cfg, engines):
    from roll_ds.pipeline.colocation.choreography import Choreography
    from roll_ds.pipeline.colocation.plan import ColocationPlan
    from roll_ds.pipeline.engines import RolloutEngines
    from roll_ds.pipeline.rollout_phase import RolloutPhase
    from roll_ds.pipeline.tasks import Tasks

    tasks = Tasks(cfg, FakeTokenizer(), eval_rows=ROWS, routes={"math": "r", "reverse": "r"})
    return RolloutPhase(
        cfg=cfg,
        engines=RolloutEngines(engines),
        clusters={"rewards.r": FakeReward()},
        colocation=Choreography(ColocationPlan()),
        tasks=tasks,
        tokenizer=FakeTokenizer(),
    )


def test_greedy_only_by_default_with_todays_metrics_and_call():
    engines = FakeEngines()
    cfg = _cfg()
    got = evaluate_policy(_phase(cfg, engines))
    # One generation, with exactly the arguments evaluate passed before sampled eval existed.
    assert engines.calls == [
        dict(seed=cfg.seed, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=8)
    ]
    today = domain_metrics(
        "eval", ["math", "reverse", "math"], [1.0, 1.0, 0.0], [{"correct": c} for c in (1, 1, 0)]
    )
    assert {k: got[k] for k in today} == today
    assert got["eval/accuracy"] == pytest.approx(2 / 3)
    assert set(got) - set(today) == {
        "eval/response_length/mean",
        "eval/response_length/p50",
        "eval/response_length/p90",
        "eval/response_length/max",
        "eval/truncated_fraction",
    }
    assert got["eval/response_length/max"] == 2.0  # "ba"; the wrong answer is "x"


def test_sampled_eval_reports_mean_and_pass_at_k_per_domain():
    engines = FakeEngines()
    cfg = _cfg(num_samples=4, sample_temperature=0.7)
    got = evaluate_policy(_phase(cfg, engines))
    assert [(c["n"], c["temperature"]) for c in engines.calls] == [(1, 0.0), (4, 0.7)]
    # right samples per row: 1, 2, 3 of 4
    assert got["eval/mean@4"] == pytest.approx((1 + 2 + 3) / 12)
    assert got["eval/math/mean@4"] == pytest.approx((1 + 3) / 8)
    assert got["eval/math/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 0 / 6)) / 2)
    assert got["eval/reverse/pass@4"] == 1.0
    assert got["eval/accuracy"] == pytest.approx(2 / 3)  # the greedy numbers are still there
    assert got["eval/sampled/response_length/max"] == 4.0  # "xxxx"
    names = set(eval_metric_names(cfg.validation, ["math", "reverse"]))
    assert set(got) <= names, set(got) - names


# --- config checks -----------------------------------------------------------------------------


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("rlvr_lora_zero3", list(overrides), check_files=False)
    return str(err.value)


def test_save_best_names_a_metric_the_config_reports():
    load_config("rlvr_lora_zero3", ["save_best=eval/math/accuracy"], check_files=False)
    load_config(
        "rlvr_lora_zero3",
        ["save_best=eval/pass@4", "validation.num_samples=4", "save_best_mode=max"],
        check_files=False,
    )
    assert "save_best: 'rollout/score' is not an eval metric" in _problems(
        "save_best=rollout/score"
    )
    assert "save_best: 'eval/pass@4' is unknown" in _problems("save_best=eval/pass@4")
    assert "'eval/chess/accuracy' is unknown" in _problems("save_best=eval/chess/accuracy")
    assert "save_best_mode: must be one of max, min, got 'median'" in _problems(
        "save_best=eval/accuracy", "save_best_mode=median"
    )


def test_save_best_needs_an_eval_at_every_save():
    text = _problems("save_best=eval/accuracy", "eval_steps=15")
    assert "save_steps (20) must be a multiple of eval_steps (15)" in text
    text = _problems("save_best=eval/accuracy", "save_steps=0")
    assert "set both (now save_steps=0, eval_steps=10)" in text


def test_sampling_fields_are_checked():
    text = _problems("validation.num_samples=4", "validation.pass_k=[2,8]")
    assert "validation.pass_k: [8] outside 1..validation.num_samples (4)" in text
    text = _problems("validation.num_samples=4", "validation.sample_temperature=0")
    assert "validation.sample_temperature: must be > 0" in text
    assert "validation.num_samples: must be >= 0" in _problems("validation.num_samples=-1")


# --- python -m roll_ds.evaluate: arguments and the report ---------------------------------------


def test_checkpoint_arg_is_taken_out_of_the_overrides():
    assert split_checkpoint_arg(["a=1", "checkpoint=/x/y", "b=2"]) == ("/x/y", ["a=1", "b=2"])
    for bad in ([], ["checkpoint="], ["checkpoint=a", "checkpoint=b"]):
        with pytest.raises(CheckpointArgError, match=r"checkpoint=<path> is .*hf/step_NNNNNN"):
            split_checkpoint_arg(bad)


def test_checkpoint_kinds_and_their_errors(tmp_path):
    with pytest.raises(CheckpointArgError, match=r"checkpoint=.*nope: no such directory; pass"):
        checkpoint_kind(tmp_path / "nope")
    hf = tmp_path / "hf" / "step_000002"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointArgError, match=r"has config\.json but no weights"):
        checkpoint_kind(hf)
    (hf / "model.safetensors").write_bytes(b"")
    assert checkpoint_kind(hf) == "hf"
    (hf / "adapter").mkdir()
    (hf / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckpointArgError, match=r"peft adapter without its base; pass .*000002"):
        checkpoint_kind(hf / "adapter")
    with pytest.raises(CheckpointArgError, match=r"holds exported models: pass one, e.g.*000002"):
        checkpoint_kind(hf.parent)
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    with pytest.raises(CheckpointArgError, match="no COMPLETE marker"):
        checkpoint_kind(ckpt)
    (ckpt / "COMPLETE").write_text("")
    (ckpt.parent / "latest").write_text(ckpt.name)
    assert checkpoint_kind(ckpt) == checkpoint_kind(ckpt.parent) == "checkpoint"
    assert result_name(hf) == "hf_step_000002"
    assert result_name(ckpt.parent / "best") == "checkpoints_best"


def test_cli_rejects_a_bad_checkpoint_before_starting_anything(tmp_path, capsys):
    assert main(["--config-name", "rlvr_lora_zero3", f"checkpoint={tmp_path / 'missing'}"]) == 2
    err = capsys.readouterr().err
    assert "roll_ds.evaluate: checkpoint=" in err and "no such directory" in err
    assert main(["--config-name", "rlvr_lora_zero3", "max_steps=0"]) == 2
    assert "checkpoint=<path> is missing" in capsys.readouterr().err


def test_eval_config_serves_the_checkpoint(tmp_path):
    cfg = _cfg()
    cfg = replace(cfg, resume_from_checkpoint="latest")
    got = eval_config(cfg, tmp_path)
    assert got.pretrain == str(tmp_path) and got.resume_from_checkpoint is None
    assert got.actor_infer.model_args.model_name_or_path is None
    assert got.actor_infer.model_args.dtype == cfg.actor_infer.model_args.dtype


def test_report_tables():
    metrics = {
        "eval/accuracy": 0.5,
        "eval/score": 0.5,
        "eval/pass@2": 0.75,
        "eval/mean@4": 0.5,
        "eval/pass@4": 0.875,
        "eval/pass@1": 0.5,
        "eval/math/accuracy": 0.25,
        "eval/math/score": 0.25,
        "eval/math/mean@4": 0.125,
        "eval/math/pass@1": 0.125,
        "eval/math/pass@2": 0.25,
        "eval/math/pass@4": 0.5,
        "eval/timeouts": 0.0,
        "eval/errors": 0.0,
        "eval/response_length/mean": 3.5,
        "eval/response_length/p50": 3.0,
        "eval/response_length/p90": 6.0,
        "eval/response_length/max": 8.0,
        "eval/truncated_fraction": 0.125,
    }
    columns, rows = table_rows(metrics)
    assert columns == ["score", "accuracy", "mean@4", "pass@1", "pass@2", "pass@4"]
    assert rows == [
        ["all", "0.5", "0.5", "0.5", "0.5", "0.75", "0.875"],
        ["math", "0.25", "0.25", "0.125", "0.125", "0.25", "0.5"],
    ]
    assert length_rows(metrics) == [["greedy", "3.5", "3", "6", "8", "0.125"]]


def test_agentic_report_shows_success_per_environment(capsys):
    from roll_ds.evaluate import print_report

    metrics = {
        "eval/success": 0.5,
        "eval/turns_per_episode": 3.0,
        "eval/tool_calls": 0.25,
        "eval/tool_errors": 0.0,
        "eval/format_errors": 0.0,
        "eval/GuessNumber/success": 0.75,
        "eval/Calculator/success": 0.25,
    }
    print_report(metrics, "step 10: 8 held-out prompts")
    out = capsys.readouterr().out
    assert "8 held-out episodes" in out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert "0.5" in rows["all"] and "0.75" in rows["GuessNumber"] and "0.25" in rows["Calculator"]
