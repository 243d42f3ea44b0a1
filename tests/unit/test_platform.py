"""The run's device decision (roll_ds/platform.py): from the config and the cluster, not from the
driver's own torch."""

from __future__ import annotations

import pytest
import torch

from roll_ds.config import ConfigError, load_config
from roll_ds.platform import (
    CPU,
    CUDA,
    VLLM_MULTIPROC_ENV,
    current_platform,
    decide_platform,
    use_platform,
)


@pytest.fixture
def restore_platform():
    previous = use_platform(None)
    yield
    use_platform(previous)


@pytest.mark.parametrize(
    ("device", "resources", "expected"),
    [
        ("auto", {"CPU": 8.0, "GPU": 16.0}, CUDA),  # CPU-only head, GPU workers
        ("auto", {"CPU": 8.0}, CPU),
        ("auto", {"CPU": 8.0, "GPU": 0.0}, CPU),
        ("cpu", {"CPU": 8.0, "GPU": 16.0}, CPU),  # GPUs in the cluster, a CPU run asked for
        ("cuda", {"CPU": 8.0}, CUDA),  # placement then says which GPUs are missing
    ],
)
def test_decided_from_the_cluster_not_the_driver(device, resources, expected):
    assert decide_platform(device, resources) == expected


def test_before_a_cluster_exists_a_local_ray_is_this_machine(restore_platform):
    assert decide_platform("auto") == current_platform()
    assert decide_platform("auto").is_cuda == torch.cuda.is_available()


def test_the_decision_becomes_the_drivers_platform(restore_platform, monkeypatch):
    monkeypatch.setenv("ROLL_DS_DEVICE", "cpu")
    assert current_platform() == CPU
    assert use_platform(CUDA) is None
    assert current_platform() == CUDA  # e.g. the transport choice on a GPU-less head
    assert current_platform().dist_backend == "nccl"
    assert use_platform(None) == CUDA
    assert current_platform() == CPU


def test_unknown_device_names_the_values():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'gpu'"):
        decide_platform("gpu", {})


def test_config_problems_name_the_field_and_the_values():
    with pytest.raises(ConfigError) as info:
        load_config("rlvr_lora_zero3", ["device=gpu", "cpus_per_gpu=0"], check_files=False)
    problems = info.value.problems
    assert "device: 'gpu' is not one of auto, cpu, cuda" in "\n".join(problems)
    assert any(p.startswith("cpus_per_gpu: must be > 0 or null") for p in problems)
    assert len(problems) == 2


def test_the_cpu_engine_runs_multiprocess_only_when_asked(monkeypatch):
    """ROLL_DS_VLLM_MULTIPROC=1: vLLM-CPU's engine core in its own process, as on GPU."""
    monkeypatch.delenv(VLLM_MULTIPROC_ENV, raising=False)
    assert CPU.vllm_env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    monkeypatch.setenv(VLLM_MULTIPROC_ENV, "1")
    assert CPU.vllm_env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert CUDA.vllm_env() == {}  # vLLM's own default there: multiprocess
    monkeypatch.setenv(VLLM_MULTIPROC_ENV, "yes")
    with pytest.raises(ValueError, match=VLLM_MULTIPROC_ENV):
        CPU.vllm_env()
