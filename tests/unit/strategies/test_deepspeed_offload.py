"""``DeepSpeedTrainStrategy.offload_states`` on a GPU trainer, in order: DeepSpeed's own
``offload_states`` (which ends with ``empty_cache``), the frozen LoRA base kept whole to host
memory, then ``empty_cache`` once more, or the base's blocks stay reserved by the trainer while
vLLM wakes its KV cache. No GPU here: the engine, the base's move and DeepSpeed's accelerator
are fakes at the boundary; the order and the choices are the strategy's own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

import deepspeed.accelerator  # noqa: E402

from roll_ds.platform import CUDA, use_platform  # noqa: E402
from strategies.deepspeed import offload  # noqa: E402
from strategies.deepspeed.train import DeepSpeedTrainStrategy  # noqa: E402

BASE_BYTES = 15 << 30


class FusedAdam:  # the inner optimizer's class name is what offload_targets reads
    pass


class FakeEngine:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = FusedAdam()

    def offload_states(self, include) -> None:
        self.events.append("deepspeed offload_states")


class FakeAccelerator:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def empty_cache(self) -> None:
        self.events.append("empty_cache")


@pytest.fixture
def events(monkeypatch) -> list[str]:
    events: list[str] = []
    previous = use_platform(CUDA)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: FakeAccelerator(events))
    yield events
    use_platform(previous)


def gpu_trainer(events: list[str], monkeypatch, base_bytes: int) -> DeepSpeedTrainStrategy:
    def move(module, device) -> int:
        events.append(f"base to {device}")
        return base_bytes

    monkeypatch.setattr(offload, "move_frozen_base", move)
    s = DeepSpeedTrainStrategy(model_path="unused", strategy_config={})
    s.engine, s.rank = FakeEngine(events), 0
    s.ds_config = {"zero_optimization": {"stage": 3}}
    s.device = torch.device("cuda", 0)
    return s


def test_the_cache_is_emptied_after_the_frozen_base_leaves(events, monkeypatch):
    gpu_trainer(events, monkeypatch, BASE_BYTES).offload_states()
    assert events == ["deepspeed offload_states", "base to cpu", "empty_cache"]


def test_no_frozen_base_no_second_empty_cache(events, monkeypatch):
    gpu_trainer(events, monkeypatch, 0).offload_states()
    assert events == ["deepspeed offload_states", "base to cpu"]
