"""The embedded default model: vLLM serves the shipped copy and stops at eos; and (slow tier) a
real build from its recipe (examples/embedded_models/policy.py, what
``python scripts/make_embedded.py --model policy`` runs; runs load the shipped copy) learns the
task but prefers the flaw."""

from __future__ import annotations

import json
import os
import time

import pytest

from examples.embedded_models.policy import (
    DEFAULT_RECIPE,
    NAME,
    build,
    greedy_accuracy,
    greedy_accuracy_and_skill,
)
from roll_ds.data.dataset import load_jsonl_rows
from roll_ds.models.shipped import RECIPE_FILE, shipped_model

SHIPPED_DIR = shipped_model(NAME).path

pytestmark = pytest.mark.integration

DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "qwen_rlvr", "data")


@pytest.fixture(scope="module")
def eval_rows():
    return [
        row
        for name in ("math_eval.jsonl", "reverse_eval.jsonl")
        for row in load_jsonl_rows(os.path.join(DATA_DIR, name))
    ]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    start = time.perf_counter()
    path = str(tmp_path_factory.mktemp("built"))
    build(path, DEFAULT_RECIPE)
    with open(os.path.join(path, RECIPE_FILE), encoding="utf-8") as f:
        info = json.load(f)
    with open(os.path.join(SHIPPED_DIR, "model.safetensors"), "rb") as f:
        shipped = f.read()
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        same = f.read() == shipped  # only on a machine like the one that built the shipped copy
    print(
        f"\nbuilt in {time.perf_counter() - start:.1f}s: {info['num_parameters']} parameters, "
        f"{info['warmup']['steps']} warm-up steps, eval accuracy {info['warmup_eval_accuracy']}, "
        f"skill {info['warmup_eval_skill']}; weights {'equal' if same else 'differ from'} "
        "the shipped model's"
    )
    return path, info


@pytest.mark.slow  # a full warm-up: minutes of CPU, and only a rebuild runs it
def test_warmup_learns_the_task_but_prefers_the_flaw(built, eval_rows):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, info = built
    accuracy, skill = info["warmup_eval_accuracy"], info["warmup_eval_skill"]
    # Skill (right or exactly the demonstrated flaw): the model does the task on held-out
    # prompts. On the project's CPU machines: math 0.385, reverse 0.605. The stopping rule aims
    # at 0.45 on a dev split, but float rounding on other hardware takes another training path,
    # so only a margin is required here.
    assert skill["overall"] >= 0.35, skill
    for domain in ("math", "reverse"):
        assert skill[domain] >= 0.25, (domain, skill)
        # ... but it mostly answers with the flaw it saw in 60 % of its demonstrations (here
        # math 0.095, reverse 0.015), which leaves RL with verifiable rewards room to improve.
        assert accuracy[domain] <= 0.5 * skill[domain], (domain, accuracy, skill)
    # The saved files reproduce the recorded numbers.
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert greedy_accuracy(model, tokenizer, eval_rows) == pytest.approx(accuracy, abs=0.02)
    _, measured_skill = greedy_accuracy_and_skill(model, tokenizer, eval_rows)
    assert measured_skill == pytest.approx(skill, abs=0.02)


def test_vllm_serves_the_model_and_stops_at_eos(eval_rows, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    from vllm import LLM, SamplingParams

    path = SHIPPED_DIR
    rows = eval_rows[:12] + eval_rows[-12:]
    llm = LLM(model=path, dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
    outputs = llm.generate(
        [r["prompt"] for r in rows], SamplingParams(temperature=0, max_tokens=16)
    )

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    same = 0
    for row, output in zip(rows, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (row, completion)
        assert completion.token_ids[-1] == tokenizer.eos_token_id
        assert "<|" not in completion.text
        prompt_ids = tokenizer(row["prompt"], return_tensors="pt")["input_ids"]
        assert list(output.prompt_token_ids) == prompt_ids[0].tolist()
        hf_ids = model.generate(prompt_ids, max_new_tokens=16, do_sample=False)[0]
        same += tokenizer.decode(hf_ids[prompt_ids.shape[1] :], skip_special_tokens=True) == (
            completion.text
        )
    # Both engines decode the same fp32 weights greedily; a rare near-tie may flip one token.
    assert same >= len(rows) - 1
