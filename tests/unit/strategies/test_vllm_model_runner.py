"""What roll_ds calls on vLLM's model runner, checked for whichever runner the engine builds:
V1 or Model Runner V2 (``strategies.vllm.start.MODEL_RUNNERS``; GPU engines build V2 wherever
Triton is usable, vLLM-CPU builds V1). The check's logic on hand-written runners, the installed
vLLM's four runner classes, and the started engine's report (no engine is started here)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from strategies.vllm.start import MODEL_RUNNERS, RUNNER_ENV, model_runner_report_problems
from strategies.vllm.worker_ext import model_runner_problems


class Runner:
    def reload_weights(self, weights_iterator=None, weights_path=None):
        pass

    def get_model(self):
        return None


class PathOnlyRunner(Runner):
    def reload_weights(self, weights_path=None):  # an older reload: no iterator
        pass


class NoModelRunner:
    def reload_weights(self, weights_iterator=None):
        pass


def test_a_runner_with_everything_has_no_problems():
    assert model_runner_problems(Runner) == []
    runner = Runner()
    runner.model_config = SimpleNamespace(hf_config=object())
    assert model_runner_problems(runner) == []


def test_each_missing_piece_is_named_after_the_runner_class():
    name = f"{__name__}.PathOnlyRunner"
    assert model_runner_problems(PathOnlyRunner) == [f"{name}.reload_weights(weights_iterator=...)"]
    assert model_runner_problems(NoModelRunner) == [f"{__name__}.NoModelRunner.get_model()"]
    # an instance: its model_config too (an attribute set at construction)
    assert model_runner_problems(Runner()) == [f"{__name__}.Runner.model_config.hf_config"]


@pytest.mark.parametrize("device_type", sorted(MODEL_RUNNERS))
def test_the_installed_vllm_runners_have_what_roll_ds_calls(device_type):
    pytest.importorskip("vllm")
    from strategies.vllm.start import model_runner_classes, vllm_api_problems

    runners, missing = model_runner_classes(device_type)
    assert len(runners) == 2 and missing == []  # V1 and V2 both ship in the 0.32 line
    assert vllm_api_problems(device_type) == []


@pytest.mark.parametrize("device_type", sorted(MODEL_RUNNERS))
def test_the_check_reads_model_runner_v2_too(device_type, monkeypatch):
    """A V2 runner without the iterator reload fails the start-up check, though V1 has it."""
    pytest.importorskip("vllm")
    from strategies.vllm.start import vllm_api_problems

    module, name = MODEL_RUNNERS[device_type][1]
    v2 = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(v2, "reload_weights", PathOnlyRunner.reload_weights)
    assert vllm_api_problems(device_type) == [
        f"{module}.{name}.reload_weights(weights_iterator=...)"
    ]


def test_the_engines_report_names_its_runner_and_the_fix():
    reports = [
        {"runner": "vllm.v1.worker.gpu.model_runner.GPUModelRunner", "problems": ["X.get_model()"]}
    ] * 2  # two TP workers, one message
    (problem,) = model_runner_report_problems(reports)
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner lacks X.get_model()" in problem
    assert f"{RUNNER_ENV}=0 or 1 in actor_infer.system_envs" in problem
    assert model_runner_report_problems([{"runner": "r", "problems": []}]) == []


def test_a_started_engine_whose_runner_lacks_a_call_is_stopped_with_the_reason():
    from strategies.vllm import VllmStrategy

    stopped = []
    engine_core = SimpleNamespace(shutdown=lambda: stopped.append(True))
    report = {"runner": "some.Runner", "problems": ["some.Runner.get_model()"]}
    strategy = VllmStrategy(model_path="unused")
    strategy.llm = SimpleNamespace(
        collective_rpc=lambda method: [report],
        llm_engine=SimpleNamespace(engine_core=engine_core),
    )
    with pytest.raises(RuntimeError, match=r"some.Runner lacks some.Runner.get_model\(\)"):
        strategy._check_model_runner()
    assert stopped == [True] and strategy.llm is None
