"""``VllmStrategy.offload_states`` / ``reload_states`` against vLLM's sleep rules: a fake
``vllm.LLM`` at the boundary records the calls vLLM would get on a GPU."""

from __future__ import annotations

import pytest

from strategies.vllm import strategy as vllm_strategy
from strategies.vllm.strategy import VllmStrategy


class FakeLLM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))


class Cuda:
    is_cuda = True


@pytest.fixture
def engine(monkeypatch) -> VllmStrategy:
    monkeypatch.setattr(vllm_strategy, "current_platform", lambda: Cuda())
    strategy = VllmStrategy(model_path="unused")
    strategy.llm = FakeLLM()
    return strategy


def test_sync_then_train_sleeps_the_weights_woken_for_the_sync(engine):
    """train -> sync (weights woken, KV cache still asleep) -> train: the second sleep must
    reach vLLM, which skips a sleep only while the *weights* are asleep."""
    engine.offload_states(level=1)
    engine.reload_states(tags=["weights"])
    engine.offload_states(level=1)
    assert engine.llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("sleep", 1)]
    assert engine._asleep == {"weights", "kv_cache"}


def test_a_second_sleep_with_the_weights_asleep_is_skipped(engine):
    engine.offload_states(level=1)
    engine.offload_states(level=1)
    assert engine.llm.calls == [("sleep", 1)]


def test_generate_refuses_while_any_tag_is_asleep(engine):
    engine.offload_states(level=1)
    engine.reload_states(tags=["weights"])
    with pytest.raises(RuntimeError, match="kv_cache are offloaded"):
        engine._require_awake()
    engine.reload_states()
    engine._require_awake()
    assert engine.llm.calls[-1] == ("wake_up", None)
