"""weight_sync.lora_sync=adapter, the pieces: the adapter directory the receiver writes (peft
loads it back exactly), its versions, the engine arguments, and config validation."""

from __future__ import annotations

import json
import os

import pytest
import torch

from roll_ds.config import ConfigError, load_config
from roll_ds.models.loading import apply_lora
from roll_ds.weight_sync.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterVersions,
    check_lora_sync,
    write_adapter,
)
from strategies.vllm.strategy import llm_kwargs, vllm_lora_rank


def lora_model(model_dir: str, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = apply_lora(model, rank=4, alpha=8, target="q_proj,v_proj")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g))
    return peft_model.eval()


def test_written_adapter_loads_back_into_peft_exactly(tiny_qwen2_dir, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    source = lora_model(tiny_qwen2_dir, seed=1)
    config = json.loads(json.dumps(source.peft_config["default"].to_dict(), default=sorted))
    sent = get_peft_model_state_dict(source)
    stats = write_adapter(iter(sent.items()), config, str(tmp_path / "v1"))
    assert sorted(os.listdir(tmp_path)) == ["v1"]  # no .partial left behind
    assert sorted(os.listdir(tmp_path / "v1")) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])
    assert stats["num_tensors"] == len(sent) == 4 * 2  # 2 layers x q,v x A,B
    assert stats["bytes"] == sum(t.numel() * 4 for t in sent.values())

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "v1")).eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, source(input_ids=ids).logits)


def test_write_adapter_refuses_merged_weights_and_empty_syncs(tmp_path):
    with pytest.raises(RuntimeError, match=r"non-adapter tensors \(e\.g\. 'model\.norm\.weight'\)"):
        write_adapter(iter([("model.norm.weight", torch.ones(2))]), {}, str(tmp_path / "a"))
    with pytest.raises(RuntimeError, match="received no tensors"):
        write_adapter(iter([]), {}, str(tmp_path / "b"))


def test_adapter_versions_keep_only_the_served_one(tmp_path):
    versions = AdapterVersions({"r": 4}, root=str(tmp_path / "root"))
    os.makedirs(versions.root)
    for expected in (1, 2, 3):
        os.makedirs(versions.next_dir())
        assert versions.commit() == expected
        assert os.listdir(versions.root) == [f"v{expected:06d}"]
        assert versions.current_dir.endswith(f"v{expected:06d}")
    versions.close()
    assert not os.path.exists(versions.root)


def test_lora_sync_modes():
    assert check_lora_sync("adapter") == "adapter"
    with pytest.raises(ValueError, match="valid: merged, adapter"):
        check_lora_sync("delta")


@pytest.mark.parametrize(("rank", "served"), [(1, 1), (4, 8), (16, 16), (17, 32), (512, 512)])
def test_vllm_lora_rank_rounds_up_to_an_allowed_value(rank, served):
    assert vllm_lora_rank(rank) == served


def test_vllm_lora_rank_beyond_vllm_names_the_field():
    with pytest.raises(ValueError, match=r"actor_train\.model_args\.lora_rank=600"):
        vllm_lora_rank(600)


def test_engine_starts_with_lora_only_for_adapter_sync():
    args = {"model_path": "/m", "dtype": "fp32", "seed": 0, "tensor_parallel_size": 1,
            "strategy_config": None, "is_cuda": False}  # fmt: skip
    assert "enable_lora" not in llm_kwargs(**args)
    kw = llm_kwargs(**args, adapter_rank=16)
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 16 and kw["max_loras"] == 1


def problems(*overrides: str, config: str = "rlvr_lora_zero3") -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, list(overrides), check_files=False)
    return info.value.problems


def test_adapter_sync_config_is_valid_for_the_lora_default():
    cfg = load_config("rlvr_lora_zero3", ["weight_sync.lora_sync=adapter"], check_files=False)
    assert cfg.weight_sync.lora_sync == "adapter"


def test_adapter_sync_problems_name_the_field_and_the_fix():
    (found,) = problems("weight_sync.lora_sync=delta")
    assert found.startswith("weight_sync.lora_sync: unknown mode 'delta'")
    full = problems("weight_sync.lora_sync=adapter", config="rlvr_full_zero3")
    assert any("needs a LoRA policy (actor_train.model_args.lora_rank)" in p for p in full), full
    hf = problems(
        "weight_sync.lora_sync=adapter", "actor_infer.strategy_args.strategy_name=hf_infer"
    )
    assert any(
        "a rollout backend that serves LoRA adapters (actor_infer.strategy_args.strategy_name" in p
        for p in hf
    ), hf
    base = problems("weight_sync.lora_sync=adapter", "actor_infer.model_args.model_name_or_path=/x")
    assert any("actor_infer must load the trainer's base model" in p for p in base), base
