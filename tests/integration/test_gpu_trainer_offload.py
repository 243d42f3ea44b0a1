"""A colocated trainer's offload on one GPU, without vLLM or Ray (``bash scripts/test.sh -m
gpu``): a LoRA model under the ZeRO-3 preset with its frozen base kept whole
(``zero3_frozen_base: whole``) trains a step, then ``offload_states`` must leave little GPU
memory cached but unused in the trainer's allocator (``memory_reserved - memory_allocated``).
DeepSpeed's ``offload_states`` empties the cache before the base moves, so without the trainer's
own ``empty_cache`` afterwards the base's blocks stayed reserved (about 15 GB for a 7B base in
bf16) while vLLM woke its KV cache. Skipped without CUDA."""

from __future__ import annotations

import math
import os
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.gpu]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 2**20
BYTE_FIGURES = ("base_bytes", "reserved_trained", "reserved_offloaded", "allocated_offloaded")
# a Qwen2 whose frozen base is ~90 MiB in fp32 (a 64 MiB tied embedding): well above the few
# MiB the allocator may keep for what DeepSpeed leaves on the GPU
BASE_QWEN2 = dict(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def base_qwen2_dir(tmp_path_factory) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**BASE_QWEN2, torch_dtype="float32"))
    path = tmp_path_factory.mktemp("base_qwen2")
    model.save_pretrained(path)
    return str(path)


def _offload_memory(model_path: str) -> dict:
    import torch
    from _train_helpers import make_strategy, nll_loss, rank_batch

    from roll_ds.models.frozen_base import frozen_buffers

    s = make_strategy(
        model_path,
        3,
        ds_extra={"zero3_frozen_base": "whole"},
        lora_rank=4,
        lora_alpha=8,
        seed=0,
    )
    base = {id(t): t for m in s.module.modules() for _, t in frozen_buffers(m)}.values()
    out = {"base_bytes": sum(t.numel() * t.element_size() for t in base)}
    out["loss"] = s.train_step(rank_batch(s.rank), nll_loss)["loss"]
    torch.cuda.synchronize()
    out["reserved_trained"] = torch.cuda.memory_reserved()
    s.offload_states()
    torch.cuda.synchronize()
    out["reserved_offloaded"] = torch.cuda.memory_reserved()
    out["allocated_offloaded"] = torch.cuda.memory_allocated()
    out["base_on_gpu"] = sum(t.device.type == "cuda" for t in base)
    s.reload_states()
    out["loss_after_reload"] = s.train_step(rank_batch(s.rank), nll_loss)["loss"]
    s.close()
    return out


def test_offload_leaves_little_reserved_on_the_trainers_gpu(base_qwen2_dir):
    from _dist import run_distributed

    (res,) = run_distributed(_offload_memory, world_size=1, args=(base_qwen2_dir,), timeout_s=600)
    mib = {k: round(res[k] / MIB, 1) for k in BYTE_FIGURES}
    print(f"\ntrainer GPU memory (MiB): {mib}")
    assert res["base_bytes"] > 64 * MIB and res["base_on_gpu"] == 0
    assert res["reserved_trained"] > res["base_bytes"]
    # what the allocator keeps cached but unused (library workspaces stay allocated either way)
    cached_free = res["reserved_offloaded"] - res["allocated_offloaded"]
    assert cached_free < res["base_bytes"] / 4, res
    assert math.isfinite(res["loss_after_reload"])  # trains on after the reload
