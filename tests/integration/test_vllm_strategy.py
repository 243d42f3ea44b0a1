"""The vllm strategy on the tiny Qwen2: one in-process vLLM-CPU engine shared by the module
(``engine``, ``conftest.py``).

Reference numbers are an fp32 HF forward of exactly the weights vLLM serves: log-probs of the
sampled tokens must agree within 1e-4. Tests that change the served weights put the original
ones back before they finish.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _vllm import TOL, hf_sampled_logprobs, prompts  # noqa: E402

from strategies.vllm import VllmStrategy  # noqa: E402

pytestmark = pytest.mark.integration


def max_logprob_gap(
    model, batch: list[list[int]], out: dict, temperature: float = 1.0, top_p: float = 1.0
) -> float:
    gap = 0.0
    for i, response, got in zip(
        out["prompt_index"], out["response_ids"], out["logprobs"], strict=True
    ):
        ref = hf_sampled_logprobs(model, batch[i], response, temperature, top_p)
        gap = max(gap, (ref - torch.tensor(got)).abs().max().item())
    return gap


def test_samples_are_reproducible_per_seed(engine):
    batch = prompts(3, 12)
    first = engine.generate(batch, n=4, max_new_tokens=16, seed=123, ignore_eos=True)
    again = engine.generate(batch, n=4, max_new_tokens=16, seed=123, ignore_eos=True)
    other = engine.generate(batch, n=4, max_new_tokens=16, seed=124, ignore_eos=True)

    assert first["prompt_index"] == [0] * 4 + [1] * 4 + [2] * 4
    assert first["sample_index"] == [0, 1, 2, 3] * 3
    assert all(len(r) == 16 for r in first["response_ids"])
    assert all(len(lp) == 16 for lp in first["logprobs"])
    assert first["response_ids"] == again["response_ids"]
    assert first["logprobs"] == again["logprobs"]
    assert first["response_ids"] != other["response_ids"]
    # the n samples of a prompt, and the samples of different prompts, are distinct draws
    assert len({tuple(r) for r in first["response_ids"]}) == 12


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9)])
def test_logprobs_are_those_of_the_sampling_distribution(engine, hf_model, temperature, top_p):
    """Each sampled token's log-prob under the distribution it was drawn from: HF's
    log_softmax(logits / T), renormalised over the top-p nucleus when there is one."""
    batch = prompts(4, 10) + prompts(2, 40, offset=5)
    out = engine.generate(
        batch, n=2, max_new_tokens=24, temperature=temperature, top_p=top_p, seed=7,
        ignore_eos=True,
    )  # fmt: skip
    gap = max_logprob_gap(hf_model, batch, out, temperature, top_p)
    print(f"\nmax |logprob vLLM - HF| (T={temperature}, top_p={top_p}): {gap:.2e}")
    assert gap <= TOL
    if temperature != 1.0:  # and they are not the raw model's
        assert max_logprob_gap(hf_model, batch, out) > 100 * TOL


def test_stop_token_ends_a_sample_and_length_caps_it(engine):
    batch = prompts(2, 12, offset=1)
    greedy = engine.generate(batch, n=1, max_new_tokens=6, temperature=0.0)
    assert greedy["finish_reason"] == ["length", "length"]
    assert [len(r) for r in greedy["response_ids"]] == [6, 6]

    # stop at the token greedy decoding emits third: the sample ends with it, included
    stops = [r[2] for r in greedy["response_ids"]]
    out = engine.generate(batch, n=1, max_new_tokens=6, temperature=0.0, stop_token_ids=stops)
    for i, response in enumerate(out["response_ids"]):
        cut = greedy["response_ids"][i].index(stops[i]) + 1
        assert response == greedy["response_ids"][i][:cut]
        assert out["finish_reason"][i] == "stop"
        assert out["stop_reason"][i] in stops
        assert len(out["logprobs"][i]) == len(response)

    ignored = engine.generate(
        batch, n=1, max_new_tokens=6, temperature=0.0, stop_token_ids=stops, ignore_eos=True
    )
    assert ignored["finish_reason"] == ["stop", "stop"]  # ignore_eos leaves stop tokens alone


def test_compute_logprobs_matches_hf_with_left_padding(engine, hf_model):
    # the 40-token row was generated from before: its KV blocks are in the prefix cache, which
    # prompt log-prob requests must not read (vLLM skips it for them)
    rows = [[5, 9, 11, 20, 33, 40, 2], [17, 3, 8], prompts(2, 40, offset=5)[1]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1

    got = engine.compute_logprobs(ids, mask)["logprobs_BT"]

    assert got.shape == (3, width - 1)
    for b, row in enumerate(rows):
        ref = hf_sampled_logprobs(hf_model, row[:1], row[1:])
        assert torch.allclose(got[b, width - len(row) :], ref, atol=TOL, rtol=0)
        assert (got[b, : width - len(row)] == 0).all()
    with pytest.raises(NotImplementedError, match="entropy"):
        engine.compute_logprobs(ids, mask, with_entropy=True)


def test_a_probe_scored_with_a_rollout_equals_it_scored_alone(engine, hf_model):
    """The weight-sync parity probe riding on a generate call (the synchronous loop's sync):
    its log-probs equal ``compute_logprobs``' and HF's, and the rollout samples what it
    samples without the probe."""
    rows = [[5, 9, 11, 20, 33, 40, 2], [17, 3, 8]]
    ids = torch.tensor([[5, 9, 11, 20, 33, 40, 2], [0, 0, 0, 0, 17, 3, 8]])
    mask = (torch.arange(7) >= torch.tensor([[0], [4]])).long()
    batch = prompts(3, 12)
    alone = engine.generate(batch, n=4, max_new_tokens=8, seed=5, ignore_eos=True)
    both = engine.generate(
        batch, n=4, max_new_tokens=8, seed=5, ignore_eos=True,
        probe={"input_ids": ids, "attention_mask": mask},
    )  # fmt: skip
    assert both["response_ids"] == alone["response_ids"]
    gap = max(abs(a - b) for x, y in zip(both["logprobs"], alone["logprobs"], strict=True)
              for a, b in zip(x, y, strict=True))  # fmt: skip
    assert gap <= TOL
    probe = both["probe_logprobs_BT"]
    assert torch.allclose(probe, engine.compute_logprobs(ids, mask)["logprobs_BT"], atol=TOL)
    for b, row in enumerate(rows):
        ref = hf_sampled_logprobs(hf_model, row[:1], row[1:])
        assert torch.allclose(probe[b, 7 - len(row) :], ref, atol=TOL, rtol=0)


def test_load_weights_serves_the_new_weights(engine, hf_model):
    batch = prompts(3, 40, offset=2)  # > one KV block: exercised through the prefix cache
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    before = engine.generate(batch, n=2, max_new_tokens=16, seed=11, ignore_eos=True)
    assert max_logprob_gap(hf_model, batch, before) <= TOL

    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf_model.parameters():  # the tied embedding is the output head too
            p.add_(0.05 * torch.randn_like(p))
    try:
        named = list(hf_model.named_parameters())  # no "lm_head.weight": the tied name is omitted
        assert "lm_head.weight" not in dict(named)
        start = time.perf_counter()
        stats = engine.load_weights(iter(named))
        print(f"\nreload of {stats['num_tensors']} tensors: {time.perf_counter() - start:.3f} s")
        assert stats["num_tensors"] == len(named) + 1  # lm_head.weight added by the worker
        assert stats["tied_lm_head"]

        after = engine.generate(batch, n=2, max_new_tokens=16, seed=11, ignore_eos=True)
        gap = max_logprob_gap(hf_model, batch, after)
        print(f"max |logprob vLLM - HF| after reload: {gap:.2e}")
        assert gap <= TOL
        # a reload that changed nothing would still match the old weights
        old_gap = _gap_to(before, after)
        assert old_gap > 1e-2, f"log-probs barely moved after a reload ({old_gap:.1e})"
    finally:
        with torch.no_grad():
            hf_model.load_state_dict(original)
        engine.load_weights(iter(hf_model.named_parameters()))  # a second reload works too
    restored = engine.generate(batch, n=2, max_new_tokens=16, seed=11, ignore_eos=True)
    assert restored["response_ids"] == before["response_ids"]
    assert max_logprob_gap(hf_model, batch, restored) <= TOL


def test_load_weights_missing_a_weight_raises(engine, hf_model):
    named = [(k, v) for k, v in hf_model.named_parameters() if "layers.1.mlp" not in k]
    with pytest.raises(RuntimeError, match="old weights"):
        engine.load_weights(iter(named))
    engine.load_weights(iter(hf_model.named_parameters()))


def test_a_reload_whose_stream_breaks_half_way_leaves_the_engine_able_to_reload(engine, hf_model):
    """A group sync that broke (the sender or another engine died) stops the weights in the
    middle of vLLM's layer-wise reload; the error surfaces, and the sync redone reloads the
    whole model and serves it (``worker_ext.abandon_reload``)."""
    named = list(hf_model.named_parameters())
    # cut inside a layer: q of the fused qkv projection arrived, k and v never will
    cut = next(i for i, (name, _) in enumerate(named) if name.endswith("q_proj.weight")) + 1

    def broken():
        yield from named[:cut]
        raise ConnectionError("weight-sync group rank 1/3: bucket 7 failed")

    with pytest.raises(ConnectionError, match="bucket 7"):
        engine.load_weights(broken())
    stats = engine.load_weights(iter(named))
    assert stats["num_tensors"] == len(named) + 1
    batch = prompts(3, 40, offset=5)
    out = engine.generate(batch, n=2, max_new_tokens=16, seed=3, ignore_eos=True)
    assert max_logprob_gap(hf_model, batch, out) <= TOL


def test_offload_and_reload_are_noops_on_cpu(engine):
    engine.offload_states()
    with pytest.raises(RuntimeError, match="reload_states"):
        engine.generate(prompts(1, 4), n=1, max_new_tokens=2)
    engine.reload_states()
    assert len(engine.generate(prompts(1, 4), n=1, max_new_tokens=2)["response_ids"]) == 1


def _gap_to(a: dict, b: dict) -> float:
    pairs = zip(a["logprobs"], b["logprobs"], strict=True)
    return max(max(abs(x - y) for x, y in zip(la, lb, strict=True)) for la, lb in pairs)


@pytest.mark.gpu
def test_gpu_tensor_parallel_sleep_wake_and_reload(tiny_qwen2_dir, hf_model):
    """GPU path: tensor parallel over the visible GPUs (up to 2), sleep/wake, reload."""
    tp = min(2, torch.cuda.device_count())
    strategy = VllmStrategy(
        model_path=tiny_qwen2_dir, dtype="fp32", seed=0, tensor_parallel_size=tp,
        strategy_config={"gpu_memory_utilization": 0.3, "enforce_eager": True},
    )  # fmt: skip
    strategy.initialize()
    try:
        batch = prompts(2, 10)
        out = strategy.generate(batch, n=2, max_new_tokens=8, seed=3, ignore_eos=True)
        assert max_logprob_gap(hf_model, batch, out) <= TOL
        strategy.offload_states()
        strategy.reload_states(tags=["weights"])
        strategy.load_weights(iter(hf_model.named_parameters()))
        strategy.reload_states()
        again = strategy.generate(batch, n=2, max_new_tokens=8, seed=3, ignore_eos=True)
        assert again["response_ids"] == out["response_ids"]
    finally:
        strategy.close()
