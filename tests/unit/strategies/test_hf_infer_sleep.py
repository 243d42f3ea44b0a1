"""hf_infer's sleep interface (what the colocation choreography calls on a rollout engine):
the state it tracks on CPU, the calls it refuses while asleep, and on a GPU the model leaving
the device and PyTorch's cache handed back."""

from __future__ import annotations

import pytest
import torch

from strategies.hf_infer import HfInferStrategy


def _strategy(model_dir: str, device: str | None = None) -> HfInferStrategy:
    s = HfInferStrategy(model_path=model_dir, max_new_tokens=4)
    s.initialize()
    if device is not None:
        s.device = torch.device(device)
        s.model.to(s.device)
    return s


def _probe() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(2, 14).reshape(2, 6)
    return ids, torch.ones_like(ids)


def test_sleep_and_wake_by_tags_like_the_vllm_strategy(tiny_qwen2_dir):
    s = _strategy(tiny_qwen2_dir)
    before = s.compute_logprobs(*_probe())["logprobs_BT"]
    weights = {n: p.detach().clone() for n, p in s.model.named_parameters()}

    s.offload_states(level=1)
    with pytest.raises(RuntimeError, match="kv_cache, weights are offloaded"):
        s.generate([[3, 4, 5]])
    with pytest.raises(RuntimeError, match="weights are offloaded"):
        s.load_weights(iter(weights.items()))
    with pytest.raises(RuntimeError, match="weights are offloaded"):
        s.compute_logprobs(*_probe())

    s.reload_states(tags=["weights"])  # the sync phase: weights back, KV cache still asleep
    s.load_weights(iter(weights.items()))
    with pytest.raises(RuntimeError, match="kv_cache are offloaded"):
        s.generate([[3, 4, 5]])

    s.reload_states(tags=["kv_cache"])  # the generate phase
    assert len(s.generate([[3, 4, 5]], n=2)["response_ids"]) == 2
    torch.testing.assert_close(s.compute_logprobs(*_probe())["logprobs_BT"], before)


def test_whole_offload_and_reload_serve_the_reference_role(tiny_qwen2_dir):
    s = _strategy(tiny_qwen2_dir)
    s.offload_states()
    s.offload_states(level=2)  # idempotent; level 2 also keeps the weights in host memory
    s.reload_states()
    s.reload_states()
    assert s.compute_logprobs(*_probe())["logprobs_BT"].shape == (2, 5)


def test_bad_levels_and_tags_are_refused(tiny_qwen2_dir):
    s = _strategy(tiny_qwen2_dir)
    with pytest.raises(ValueError, match=r"level must be one of \(1, 2\), got 3"):
        s.offload_states(level=3)
    with pytest.raises(ValueError, match=r"unknown tags \['kv'\]"):
        s.reload_states(tags=["kv"])
    with pytest.raises(RuntimeError, match="initialize"):
        HfInferStrategy(model_path=tiny_qwen2_dir).offload_states()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sleep_moves_the_model_off_the_gpu_and_releases_the_cache(tiny_qwen2_dir):
    s = _strategy(tiny_qwen2_dir, "cuda:0")
    s.generate([[3, 4, 5]] * 8, n=4)  # leaves activations and KV blocks in the cache
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    s.offload_states(level=1)
    asleep = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert next(s.model.parameters()).device.type == "cpu"
    assert asleep[0] < awake[0] and asleep[1] < awake[1], (awake, asleep)
    s.reload_states(tags=["weights"])
    assert next(s.model.parameters()).device.type == "cuda"
    s.reload_states()
    assert len(s.generate([[3, 4, 5]])["response_ids"]) == 1
    print(f"\nhf_infer allocated / reserved bytes: awake {awake}, asleep {asleep}")
