"""Shared test fixtures: thread limits, hub off, GPU-test skipping, a tiny random Qwen2 model."""

from __future__ import annotations

import os

# Two cores are shared by every process a test starts: keep each one to a single thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


TINY_QWEN2 = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32: the minimum vLLM's CPU attention accepts
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Qwen2 (fp32, tied embeddings) saved in HF format, without a tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2, torch_dtype="float32"))
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def cached_compose():
    """Hydra composes a shipped config in about 0.25 s, and the tests compose the same few
    (config, overrides) pairs hundreds of times: each pair is composed once per session and
    every caller gets its own deep copy. Only the shipped configs (``config_dir=None``): a test's
    own directory may change between calls. What ``load_config`` does after composing (the
    schema, the validation) still runs every time, and a compose that fails is not cached."""
    import copy

    from roll_ds.config import compose

    original = compose.compose_config
    cache: dict = {}

    def cached(config_name, overrides=None, config_dir=None, *, replace=True):
        if config_dir is not None:
            return original(config_name, overrides, config_dir, replace=replace)
        key = (config_name, tuple(overrides or ()), replace)
        if key not in cache:
            cache[key] = original(config_name, overrides, None, replace=replace)
        return copy.deepcopy(cache[key])

    compose.compose_config = cached
    yield cache
    compose.compose_config = original
