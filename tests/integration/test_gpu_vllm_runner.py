"""Which model runner a GPU engine builds, and that it has what roll_ds calls (``bash
scripts/test.sh -m gpu``). vLLM picks Model Runner V2 wherever Triton is usable (every GPU
image) and V1 otherwise; CPU runs only ever build V1, so this is where V2 meets roll_ds's worker
extension: the runner reported by the workers is the one the engine's config says, its report
is clean, and a reload through it serves the weights it was given. Skipped without CUDA."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpu import NEEDS_VLLM

pytestmark = [pytest.mark.integration, pytest.mark.gpu, NEEDS_VLLM]

ENGINE = {"enforce_eager": True, "gpu_memory_utilization": 0.25, "max_num_seqs": 8}


def test_the_engines_model_runner_has_what_roll_ds_calls(tiny_qwen2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from strategies.vllm import VllmStrategy
    from strategies.vllm.start import MODEL_RUNNERS

    strategy = VllmStrategy(
        model_path=tiny_qwen2_dir, dtype="fp32", seed=0, strategy_config=dict(ENGINE)
    )
    strategy.initialize()
    try:
        (report,) = strategy.llm.collective_rpc("roll_ds_model_runner")
        v2 = strategy.llm.llm_engine.vllm_config.use_v2_model_runner
        module, name = MODEL_RUNNERS["cuda"][1 if v2 else 0]
        print(f"\nvLLM model runner: {report['runner']} (use_v2_model_runner={v2})")
        assert report == {"runner": f"{module}.{name}", "problems": []}
        assert strategy.model_runner == report["runner"]

        torch.manual_seed(1)  # other weights than the checkpoint's, reloaded through the runner
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.1)
        stats = strategy.load_weights(iter(model.state_dict().items()))
        assert stats["tied_lm_head"] and stats["num_tensors"] >= len(model.state_dict())
        out = strategy.generate([[3, 5, 7, 9]], n=2, max_new_tokens=6, seed=7, ignore_eos=True)
        assert [len(r) for r in out["response_ids"]] == [6, 6]
    finally:
        strategy.close()
