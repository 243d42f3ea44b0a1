"""ZeRO++ keys in a whole config: refused on CPU (validation for ``device: cpu``, the launch's
platform decision for ``device: auto``) and, for hpZ, on one node or across nodes, before any
actor starts (for a local Ray, ``device: auto`` in validation: test_device_auto.py). The pure
checks are in test_deepspeed_config.py."""

from __future__ import annotations

import pytest

from roll_ds.config import ConfigError, load_config
from roll_ds.platform import use_platform

FIELD = "actor_train.strategy_args.strategy_config"
FULL = ["actor_train.model_args.lora_rank=null"]


def _load(*overrides: str):
    return load_config("rlvr_lora_zero3", [*FULL, *overrides], check_files=False)


def test_quantized_weights_refused_on_cpu():
    with pytest.raises(ConfigError) as err:
        _load("device=cpu", "deepspeed_zero3.zero_optimization.zero_quantized_weights=true")
    assert f"{FIELD}: zero_optimization.zero_quantized_weights (ZeRO++) need CUDA GPUs" in str(
        err.value
    )


def test_hpz_on_one_node_is_refused():
    with pytest.raises(ConfigError) as err:
        _load("device=cuda", "deepspeed_zero3.zero_optimization.zero_hpz_partition_size=2")
    field = f"{FIELD}.zero_optimization.zero_hpz_partition_size"
    assert f"{field}: 2 on a role whose 2 ranks share one node" in str(err.value)


MULTI_NODE = [
    "device=cuda",
    "num_nodes=2",
    "num_gpus_per_node=4",
    "actor_train.device_mapping=0-7",
    "actor_infer.device_mapping=0-7",
    "+actor_infer.strategy_args.strategy_config.gpu_memory_utilization=0.7",
    "actor_train.training_args.per_device_train_batch_size=4",
    "actor_train.training_args.gradient_accumulation_steps=1",
]


def test_hpz_across_two_nodes():
    _load(*MULTI_NODE, "deepspeed_zero3.zero_optimization.zero_hpz_partition_size=4")
    with pytest.raises(ConfigError) as err:
        _load(*MULTI_NODE, "deepspeed_zero3.zero_optimization.zero_hpz_partition_size=3")
    assert "zero_hpz_partition_size: 3 does not divide the role's ranks per node (4)" in str(
        err.value
    )


def test_auto_device_of_a_joined_cpu_cluster_refuses_zeropp_before_actors(monkeypatch):
    from roll_ds.distributed import resource_manager

    # a cluster to join: its device is known once connected (a local Ray: test_device_auto.py)
    cfg = _load(
        "ray.address=ray://head:10001",
        "deepspeed_zero3.zero_optimization.zero_quantized_gradients=true",
    )
    monkeypatch.setattr(resource_manager.ray, "cluster_resources", lambda: {"CPU": 2.0})
    try:
        with pytest.raises(
            ConfigError, match="zero_quantized_gradients \\(ZeRO\\+\\+\\) need CUDA"
        ):
            resource_manager.decide_run_platform(cfg)
    finally:
        use_platform(None)


def test_the_documented_16_gpu_command_validates():
    """docs/zero.md's ZeRO++ example: hpZ over each 8-GPU node of two, quantized weights."""
    cfg = load_config(
        "rlvr_qwen2.5_7b_lora_zero3_16gpu",
        [
            "deepspeed_zero3.zero_optimization.zero_hpz_partition_size=8",
            "deepspeed_zero3.zero_optimization.zero_quantized_weights=true",
        ],
        check_files=False,
    )
    zero = cfg.actor_train.strategy_args.strategy_config["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 8
