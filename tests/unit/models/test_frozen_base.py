"""``keep_frozen_base_whole``: a LoRA model's frozen weights become marked buffers (same names,
same outputs, a tied weight one tensor), out of ``parameters()`` and ``state_dict()``, and
``weight_units`` still produces every merged HF weight from them."""

from __future__ import annotations

import pytest
import torch

from roll_ds.models.frozen_base import (
    count_frozen_whole,
    frozen_buffers,
    keep_frozen_base_whole,
    named_weights,
)
from roll_ds.models.lora import weight_units


@pytest.fixture
def lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = get_peft_model(
        Qwen2ForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    with torch.no_grad():  # a non-zero adapter, so merging matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model


def _produced(model) -> dict[str, torch.Tensor]:
    return {n: t for unit in weight_units(model) for n, t in unit.produce()}


def test_frozen_weights_become_buffers_and_outputs_do_not_change(lora_model):
    ids = torch.randint(0, 64, (2, 8))
    before_logits = lora_model(input_ids=ids).logits
    before_weights = _produced(lora_model)
    before_names = [n for n, _ in lora_model.named_parameters()]
    trainable = {n for n, p in lora_model.named_parameters() if p.requires_grad}

    moved = keep_frozen_base_whole(lora_model)

    assert moved == len(before_names) - len(trainable)  # the tied head is the embedding
    assert {n for n, _ in lora_model.named_parameters()} == trainable
    assert [n for n, _ in named_weights(lora_model)] == before_names  # same names, same order
    assert not any("base_layer" in k or "embed_tokens" in k for k in lora_model.state_dict())
    hf = lora_model.get_base_model()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert frozen_buffers(hf.lm_head) == [("weight", hf.lm_head.weight)]
    assert count_frozen_whole(lora_model) == moved
    torch.testing.assert_close(lora_model(input_ids=ids).logits, before_logits, rtol=0, atol=0)
    after_weights = _produced(lora_model)
    assert after_weights.keys() == before_weights.keys() and "lm_head.weight" in after_weights
    for name, tensor in before_weights.items():
        torch.testing.assert_close(after_weights[name], tensor, rtol=0, atol=0)


def test_the_adapter_still_trains(lora_model):
    keep_frozen_base_whole(lora_model)
    ids = torch.randint(0, 64, (2, 8))
    lora_model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in lora_model.named_parameters()}
    assert grads and all(g is not None for g in grads.values())
    assert all(".lora_" in n for n in grads)


def test_a_later_move_keeps_the_names(lora_model):
    keep_frozen_base_whole(lora_model, torch.device("cpu"))
    before = _produced(lora_model)
    lora_model.to(torch.float64)  # replaces every buffer tensor (and unties the head)
    after = _produced(lora_model)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name].float(), tensor)


def test_a_partitioned_model_is_refused(lora_model):
    next(lora_model.parameters()).ds_id = 0
    with pytest.raises(ValueError, match="load it whole"):
        keep_frozen_base_whole(lora_model)


def test_move_frozen_base_is_a_no_op_where_the_weights_are(lora_model):
    from roll_ds.models.frozen_base import move_frozen_base

    keep_frozen_base_whole(lora_model)
    assert move_frozen_base(lora_model, "cpu") == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_move_frozen_base_moves_each_weight_once_and_keeps_ties(lora_model):
    """What a colocated trainer does around generation: the whole frozen base to host memory
    and back (DeepSpeed's offload_states moves only the states it owns)."""
    from roll_ds.models.frozen_base import move_frozen_base

    lora_model.cuda()
    keep_frozen_base_whole(lora_model)
    inner = lora_model.base_model.model
    embed = inner.model.embed_tokens.weight
    frozen = {id(t): t for _, t in named_weights(lora_model)}
    frozen = [t for t in frozen.values() if not isinstance(t, torch.nn.Parameter)]
    total = sum(t.numel() * t.element_size() for t in frozen)
    assert move_frozen_base(lora_model, "cpu") == total  # the tied embedding once
    assert inner.model.embed_tokens.weight is embed and embed.device.type == "cpu"
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # still tied
    assert all(p.is_cuda for p in lora_model.parameters())  # the adapter stays
    assert move_frozen_base(lora_model, "cuda") == total
    assert embed.is_cuda
