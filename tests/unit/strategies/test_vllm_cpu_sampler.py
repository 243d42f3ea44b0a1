"""On CPU the vLLM sampler counts token ranks eagerly (``strategies/vllm/cpu_sampler.py``): the
same integers as vLLM's compiled count, without its first-request torch.compile."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from strategies.vllm.cpu_sampler import COUNT_NAME, count_at_least, eager_token_ranks  # noqa: E402


def test_the_eager_count_is_vllms_expression_with_ties():
    from vllm.v1.sample.ops import logprobs as ops

    vllms = ops.batched_count_greater_than._torchdynamo_orig_callable  # its Python, uncompiled
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g).log_softmax(-1)
    x[0, :5] = x[0, 5]  # ties count as "at least"
    values = x.gather(-1, torch.randint(0, 40, (6, 1), generator=g))
    assert torch.equal(count_at_least(x, values), vllms(x, values))
    assert int(count_at_least(x[:1], x[:1, 5:6])[0]) >= 6  # the five ties and itself


def test_the_sampler_gets_the_eager_count(monkeypatch):
    import vllm.v1.sample.sampler as sampler

    monkeypatch.setattr(sampler, COUNT_NAME, getattr(sampler, COUNT_NAME))  # restored after
    assert eager_token_ranks() is True
    assert getattr(sampler, COUNT_NAME) is count_at_least


def test_a_vllm_without_the_count_is_left_alone(monkeypatch):
    import vllm.v1.sample.sampler as sampler

    monkeypatch.delattr(sampler, COUNT_NAME)
    assert eager_token_ranks() is False
    assert not hasattr(sampler, COUNT_NAME)
