"""roll_ds.perf: the training FLOP count against a hand count and against torch's own counter
on the tiny Qwen2, the spec-sheet peaks by device name, the measured peak's budget and cache."""

from __future__ import annotations

import pytest
import torch

from roll_ds import perf
from roll_ds.perf import TransformerShape, perf_metrics, spec_peak_tflops
from tests.conftest import TINY_QWEN2


def _tiny_config(attn: str = "eager"):
    from transformers import Qwen2Config

    config = Qwen2Config(**TINY_QWEN2)
    config._attn_implementation = attn
    return config


def test_hand_count_of_the_tiny_config():
    shape = TransformerShape.from_hf_config(_tiny_config())
    # h 128, 4 query and 2 key-value heads of 32, MLP 256 (gate, up, down), vocab 128, 2 layers
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256
    assert per_layer == 147_456
    assert shape.matmul_params() == 2 * per_layer + 128 * 128 == 311_296
    assert shape.matmul_params(value_head=True) == 2 * per_layer + 128
    # one sequence of 12 tokens: 2 FLOPs per weight and token, 4·layers·H·d·L² of attention
    forward = 2 * 311_296 * 12 + 4 * 2 * 4 * 32 * 12 * 12
    assert shape.forward_flops([12]) == forward == 7_618_560
    assert shape.train_flops([12]) == 3 * forward
    # sequences count at their own lengths: attention grows with L², the rest with L
    assert shape.train_flops([5, 7]) == shape.train_flops([5]) + shape.train_flops([7])
    assert shape.train_flops([5, 7]) < shape.train_flops([12])
    # LoRA: frozen weights 2x forward, attention 3x, the 1000 adapter parameters 6 per token
    lora = 4 * 311_296 * 12 + 3 * 4 * 2 * 4 * 32 * 144 + 6 * 1000 * 12
    assert shape.train_flops([12], trainable_params=1000) == lora


def _counted(model, ids) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
    return counter.get_total_flops()


def test_count_equals_torch_flop_counter_on_the_tiny_model():
    """Eager attention (FlopCounterMode does not count the CPU SDPA kernel): forward and
    backward of 3 sequences of 12 tokens, full fine-tuning and LoRA on every linear layer with
    the embedding output requiring grad (as with gradient checkpointing, the trainer's
    default)."""
    from transformers import Qwen2ForCausalLM

    from roll_ds.models.loading import apply_lora

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (3, 12))
    config = _tiny_config()
    shape = TransformerShape.from_hf_config(config)
    assert _counted(Qwen2ForCausalLM(config), ids) == shape.train_flops([12] * 3) == 68_567_040

    model = Qwen2ForCausalLM(config)
    model.enable_input_require_grads()
    model = apply_lora(model, rank=4, alpha=8, dropout=0.0, target="all-linear")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert _counted(model, ids) == shape.train_flops([12] * 3, trainable_params=trainable)


def test_mixture_of_experts_is_refused():
    from transformers import Qwen2MoeConfig

    with pytest.raises(ValueError, match="mixture-of-experts"):
        TransformerShape.from_hf_config(Qwen2MoeConfig(num_experts=4))


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "fp32", 60.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
        ("NVIDIA L4", "bf16", None),  # not in the table: measured instead
    ],
)
def test_spec_peaks_by_device_name(name, dtype, tflops):
    assert spec_peak_tflops(name, dtype) == tflops


def test_measured_cpu_peak_is_cached_and_leaves_the_global_rng_alone():
    perf.measured_peak_flops.cache_clear()
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    first, source = perf.peak_flops(torch.device("cpu"), "fp32")
    assert source == "measured" and first > 1e8  # any CPU multiplies faster than 0.1 GFLOP/s
    assert torch.equal(torch.rand(3), expected_next)  # the training run's RNG stream unmoved
    assert perf.peak_flops(torch.device("cpu"), "fp32")[0] == first
    assert perf.measured_peak_flops.cache_info().hits == 1


def test_perf_metrics():
    m = perf_metrics(flops=3e12, seconds=2.0, peak=6e12)
    assert m == {"perf/tflops": 1.5, "perf/mfu": 0.25, "perf/peak_tflops": 6.0}
