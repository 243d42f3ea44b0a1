"""Training FLOPs counted from the model config, and the device peak they are measured against:
``perf/tflops`` and ``perf/mfu`` of a train step.

The count (``TransformerShape``) is of model FLOPs: the matrix multiplies a decoder-only
transformer needs for the tokens it trains, 2 FLOPs per multiply-add, whatever the kernels do
(gradient checkpointing's recomputed forward, padding, a causal kernel skipping masked blocks are
not counted; norms, activations, softmax and the optimizer are not matmuls). With per layer

    N_layer = h·(H·d) + 2·h·(K·d) + (H·d)·h + m·h·i      q, k, v, o projections; the MLP
    N_mm    = layers·N_layer + h·V                        every matmul weight a token passes

(``h`` hidden size, ``H`` / ``K`` query / key-value heads of size ``d``, ``i`` the MLP's
intermediate size with ``m`` = 3 matrices for a gated MLP, 2 without; ``V`` the vocabulary, or 1
for a value head; the embedding lookup is no matmul), the forward of one sequence of ``L``
tokens costs

    F(L) = 2·N_mm·L + 4·layers·H·d·L²

the second term being the attention scores ``Q·Kᵀ`` and their product with ``V`` over the full
``L x L`` matrix (PaLM's MFU convention, and what ``torch.utils.flop_counter`` charges
``scaled_dot_product_attention``). The backward costs twice the forward: each matmul's gradient
with respect to its input and to its weight. So training one sequence costs

    full fine-tuning:  3·F(L)
    LoRA:              4·N_mm·L + 12·layers·H·d·L² + 6·P·L

where a frozen weight's gradient is never formed (its matmul costs 2·forward) and ``P`` is the
number of trainable parameters (the adapters' ``A`` and ``B`` matrices, each used once per
token; a trainable value head is counted there too, and once more, frozen, in ``N_mm``: 4·h per
token). A step's FLOPs are the sum over its sequences, each at its own length (the real tokens
of its attention mask).

The peak (``peak_flops``) is the dense figure of the device's spec sheet on the GPUs in
``GPU_PEAK_TFLOPS``, and otherwise (a CPU, another GPU) a short measured matmul in the training
dtype, once per process.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Dense (no sparsity) peak TFLOP/s per dtype from NVIDIA's data sheets; the first name found in
# the device's name wins, so the more specific come first. fp32 is the CUDA-core figure: torch
# multiplies fp32 matrices without TF32 unless torch.backends.cuda.matmul.allow_tf32 is set.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},  # SXM ("H100 80GB HBM3")
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
}
MEASURE_BUDGET_S = 0.25  # the longest a measured peak takes (after one warm-up multiply)


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes the FLOP count needs (module doc), read from an HF config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True  # gate, up and down (Qwen2, Llama, Mistral); False: up and down

    @classmethod
    def from_hf_config(cls, config: Any) -> TransformerShape:
        """From a dense decoder config with a gated MLP (Qwen2, Llama, Mistral and their
        field names); a mixture-of-experts config is refused (a token passes only some
        experts' weights)."""
        for moe in ("num_experts", "num_local_experts", "n_routed_experts"):
            if getattr(config, moe, None):
                raise ValueError(f"no FLOP count for a mixture-of-experts model ({moe})")
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
        )

    def matmul_params(self, *, value_head: bool = False) -> int:
        """``N_mm``: the matmul weights one token passes (module doc)."""
        h, attn, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate
        per_layer = h * attn + 2 * h * kv + attn * h + mlp
        return self.layers * per_layer + h * (1 if value_head else self.vocab)

    def forward_flops(self, lengths: Iterable[int], *, value_head: bool = False) -> int:
        """``sum F(L)`` over sequences of ``lengths`` tokens."""
        lengths = list(lengths)
        tokens, squares = sum(lengths), sum(n * n for n in lengths)
        linear = 2 * self.matmul_params(value_head=value_head) * tokens
        return linear + self._attention_flops(squares)

    def train_flops(
        self,
        lengths: Iterable[int],
        *,
        trainable_params: int | None = None,
        value_head: bool = False,
    ) -> int:
        """Forward and backward FLOPs of training on sequences of ``lengths`` tokens: full
        fine-tuning when ``trainable_params`` is None, else LoRA with that many trainable
        parameters (module doc)."""
        lengths = list(lengths)
        if trainable_params is None:
            return 3 * self.forward_flops(lengths, value_head=value_head)
        tokens, squares = sum(lengths), sum(n * n for n in lengths)
        frozen = 4 * self.matmul_params(value_head=value_head) * tokens
        return frozen + 3 * self._attention_flops(squares) + 6 * trainable_params * tokens

    def _attention_flops(self, squares: int) -> int:
        """Forward ``Q·Kᵀ`` and scores x ``V`` of sequences whose squared lengths sum to
        ``squares``: 2 matmuls of ``2·L·L·d`` FLOPs per head and layer."""
        return 4 * self.layers * self.heads * self.head_dim * squares


def spec_peak_tflops(device_name: str, dtype: str) -> float | None:
    """The spec-sheet dense peak of the GPU named ``device_name`` at ``dtype`` (fp32 | bf16 |
    fp16), None for a device not in ``GPU_PEAK_TFLOPS``."""
    for name, peaks in GPU_PEAK_TFLOPS.items():
        if name.lower() in device_name.lower():
            return peaks.get(dtype)
    return None


@functools.cache
def measured_peak_flops(device: str, dtype: str, threads: int) -> float:
    """FLOP/s of the best of a few square matmuls (``F.linear``) at ``dtype`` on ``device``
    (``cpu`` or ``cuda:N``) within ``MEASURE_BUDGET_S``; cached per process (``threads``: torch's
    intra-op threads, part of the key because the figure depends on them)."""
    import torch

    from roll_ds.models.tensors import torch_dtype

    dev = torch.device(device)
    n = 2048 if dev.type == "cuda" else 512
    # Its own generator: drawing from the global one would move the training run's RNG stream.
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(torch_dtype(dtype))
    b = torch.randn(n, n, device=dev, generator=gen).to(torch_dtype(dtype))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # F.linear, the op every nn.Linear of the model runs: on a CPU without native bf16 (AVX2
    # only) torch.mm multiplies bf16 matrices ~8x slower than linear does (0.5 vs 4 GFLOP/s
    # per thread, measured on this project's AMD EPYC), and a peak measured with it put MFU > 1.
    linear = torch.nn.functional.linear
    linear(a, b)  # warm-up: kernel selection, allocation
    sync()
    best, spent = 0.0, 0.0
    while spent < MEASURE_BUDGET_S:
        start = time.perf_counter()
        linear(a, b)
        sync()
        took = time.perf_counter() - start
        spent += took
        best = max(best, 2 * n**3 / max(took, 1e-9))
    del threads  # in the cache key only
    return best


def peak_flops(device: Any, dtype: str) -> tuple[float, str]:
    """The peak FLOP/s one ``device`` (a ``torch.device``) reaches at ``dtype``, and where it
    comes from: ``spec`` (``GPU_PEAK_TFLOPS``) or ``measured`` (``measured_peak_flops``)."""
    import torch

    if device.type == "cuda":
        tflops = spec_peak_tflops(torch.cuda.get_device_name(device), dtype)
        if tflops is not None:
            return tflops * 1e12, "spec"
    return measured_peak_flops(str(device), dtype, torch.get_num_threads()), "measured"


def perf_metrics(flops: float, seconds: float, peak: float) -> dict[str, float]:
    """``perf/tflops`` (per device) and ``perf/mfu`` of ``flops`` done in ``seconds`` on a device
    of ``peak`` FLOP/s, with ``perf/peak_tflops``."""
    rate = flops / max(seconds, 1e-9)
    return {
        "perf/tflops": rate / 1e12,
        "perf/mfu": rate / peak if peak > 0 else 0.0,
        "perf/peak_tflops": peak / 1e12,
    }


@dataclass(frozen=True)
class TrainPerf:
    """A trainer's ``perf/*`` figures: its model's shape, the trainable parameters under LoRA
    (None: full fine-tuning) and its device's peak at the training dtype."""

    shape: TransformerShape
    trainable: int | None
    peak: float

    @classmethod
    def for_model(
        cls, hf_config: Any, trainable: int | None, device: Any, dtype: str
    ) -> TrainPerf | None:
        """None (and a warning) for a model ``TransformerShape`` cannot count (MoE, a config
        without the usual fields)."""
        try:
            shape = TransformerShape.from_hf_config(hf_config)
        except (ValueError, AttributeError) as exc:
            logger.warning("no perf/tflops or perf/mfu for this model: %s", exc)
            return None
        peak, source = peak_flops(device, dtype)
        logger.info("peak %.3g TFLOP/s at %s (%s)", peak / 1e12, dtype, source)
        return cls(shape, trainable, peak)

    @classmethod
    def for_module(
        cls, module: Any, model_path: str, lora: bool, device: Any, dtype: str
    ) -> TrainPerf | None:
        """``for_model`` of a built (possibly ZeRO-3 partitioned) trainer module."""
        from transformers import AutoConfig

        trainable = sum(
            getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad
        )
        config = AutoConfig.from_pretrained(model_path)
        return cls.for_model(config, trainable if lora else None, device, dtype)

    def metrics(self, lengths: list[int], seconds: float, *, value_head: bool) -> dict[str, float]:
        """``perf_metrics`` of a train step over rows of ``lengths`` real tokens."""
        flops = self.shape.train_flops(
            lengths, trainable_params=self.trainable, value_head=value_head
        )
        return perf_metrics(flops, seconds, self.peak)
