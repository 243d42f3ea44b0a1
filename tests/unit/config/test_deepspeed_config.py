from pathlib import Path

import pytest
import yaml

from roll_ds.config.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedInputs,
    build_deepspeed_config,
    check_deepspeed_config,
    fp16_train_problems,
    nvme_paths,
    offload_devices,
    zero_stage,
)
from roll_ds.config.zeropp import zeropp_device_problems, zeropp_keys, zeropp_topology_problems

PRESETS = Path(__file__).resolve().parents[3] / "examples" / "config"


def preset(name: str) -> dict:
    return yaml.safe_load((PRESETS / f"{name}.yaml").read_text())[name]


def inputs(**kw) -> DeepSpeedInputs:
    base = dict(
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        dp_size=2,
        max_grad_norm=1.0,
        dtype="bf16",
    )
    return DeepSpeedInputs(**{**base, **kw})


@pytest.mark.parametrize(
    ("name", "stage", "offload"),
    [
        ("deepspeed_zero", 0, {}),
        ("deepspeed_zero2", 2, {}),
        ("deepspeed_zero2_cpuoffload", 2, {"offload_optimizer": "cpu"}),
        ("deepspeed_zero3", 3, {}),
        ("deepspeed_zero3_cpuoffload", 3, {"offload_optimizer": "cpu", "offload_param": "cpu"}),
        ("deepspeed_zero3_nvme", 3, {"offload_optimizer": "nvme", "offload_param": "nvme"}),
    ],
)
def test_presets_have_root_key_named_like_file_and_build(name, stage, offload):
    cfg = preset(name)
    assert zero_stage(cfg) == stage
    assert offload_devices(cfg) == offload
    built = build_deepspeed_config(
        cfg, inputs(hidden_size=128, nvme_dir="/nvme/actor_train", largest_numel=1001)
    )
    assert built["train_micro_batch_size_per_gpu"] == 4
    assert built["gradient_accumulation_steps"] == 2
    assert built["train_batch_size"] == 16  # 4 x 2 x 2
    assert built["gradient_clipping"] == 1.0
    assert built["bf16"]["enabled"] is True
    assert built["fp16"]["enabled"] is False
    assert "auto" not in repr(built)
    if stage == 3:
        zero = built["zero_optimization"]
        assert zero["reduce_bucket_size"] == 128 * 128
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 128 * 128)
        assert zero["stage3_param_persistence_threshold"] == 1280


def test_auto_bucket_sizes_fall_back_to_deepspeed_defaults_without_hidden_size():
    built = build_deepspeed_config(preset("deepspeed_zero3"), inputs())
    assert "reduce_bucket_size" not in built["zero_optimization"]
    assert built["zero_optimization"]["stage3_max_live_parameters"] == 1_000_000_000


def test_input_is_not_mutated():
    cfg = preset("deepspeed_zero2")
    build_deepspeed_config(cfg, inputs())
    assert cfg["train_batch_size"] == "auto"


def test_fp16_and_fp32():
    fp16 = build_deepspeed_config(preset("deepspeed_zero2"), inputs(dtype="fp16"))
    assert fp16["fp16"]["enabled"] is True
    assert fp16["bf16"]["enabled"] is False
    fp32 = build_deepspeed_config(preset("deepspeed_zero2"), inputs(dtype="fp32"))
    assert not fp32["fp16"]["enabled"]
    assert not fp32["bf16"]["enabled"]


def test_fp16_training_needs_a_zero_optimizer():
    # DeepSpeed scales the loss only for its ZeRO optimizers: ZeRO-0 fp16 would shrink updates
    zero0 = build_deepspeed_config(preset("deepspeed_zero"), inputs(dtype="fp16"))
    (problem,) = fp16_train_problems(zero0, "actor_train.strategy_args.strategy_config")
    assert problem.startswith("actor_train.strategy_args.strategy_config.fp16: fp16 training")
    assert "${deepspeed_zero2}" in problem and "bf16" in problem
    for name in ("deepspeed_zero2", "deepspeed_zero3"):
        assert (
            fp16_train_problems(build_deepspeed_config(preset(name), inputs(dtype="fp16")), "x")
            == []
        )
    assert (
        fp16_train_problems(build_deepspeed_config(preset("deepspeed_zero"), inputs()), "x") == []
    )


def test_explicit_train_batch_size_is_checked():
    cfg = {**preset("deepspeed_zero2"), "train_batch_size": 10}
    with pytest.raises(
        DeepSpeedConfigError, match=r"10 != micro batch 4 x accumulation 2 x .* = 16"
    ):
        build_deepspeed_config(cfg, inputs())


def test_explicit_micro_batch_must_match_training_args():
    cfg = {**preset("deepspeed_zero2"), "train_micro_batch_size_per_gpu": 8}
    with pytest.raises(DeepSpeedConfigError, match="disagree with training_args"):
        build_deepspeed_config(cfg, inputs())


def test_unknown_auto_is_named():
    cfg = {**preset("deepspeed_zero"), "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer\.params\.lr"):
        build_deepspeed_config(cfg, inputs())


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        ({"stage": 4}, "4 is not a ZeRO stage; use one of 0, 1, 2, 3"),
        (
            {"stage": 1, "offload_optimizer": {"device": "cpu"}},
            "optimizer offload needs ZeRO stage 2",
        ),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "parameter offload needs ZeRO stage 3"),
        ({"stage": 3, "offload_param": {"device": "gpu"}}, "'gpu' is not cpu, nvme or none"),
    ],
)
def test_bad_zero_sections(zero, message):
    problems = check_deepspeed_config({"zero_optimization": zero}, "x")
    assert any(message in p for p in problems), problems


def test_offload_device_none_is_off():
    cfg = {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}}}
    assert check_deepspeed_config(cfg, "x") == []


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"zero_optimization": {"stage": True}}, "x.zero_optimization.stage: True is not a ZeRO"),
        ({"zero_optimization": 3}, "x.zero_optimization: must be a mapping, got 3"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}},
            "x.zero_optimization.offload_optimizer: must be a mapping, got 'cpu'",
        ),
        (
            {"train_micro_batch_size_per_gpu": 0},
            "x.train_micro_batch_size_per_gpu: must be a number",
        ),
        (
            {"gradient_clipping": -1.0},
            "x.gradient_clipping: must be a number >= 0 (0: no clipping)",
        ),
        ({"steps_per_print": "often"}, "x.steps_per_print: must be a number >= 1, got 'often'"),
        ({"fp16": {"loss_scale": -1}}, "x.fp16.loss_scale: must be a number >= 0 (0: dynamic"),
        ({"fp16": {"hysteresis": 0}}, "x.fp16.hysteresis: must be a number >= 1, got 0"),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}},
            "x.zero_optimization.reduce_bucket_size: must be a number >= 1, got 0",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -5}},
            "x.zero_optimization.stage3_max_live_parameters: must be a number >= 0, got -5",
        ),
        (
            {"zero_optimization": {"stage": 2, "overlap_comm": "yes"}},
            "x.zero_optimization.overlap_comm: must be true or false, got 'yes'",
        ),
        (
            {"bf16": {"enabled": "maybe"}},
            "x.bf16.enabled: must be true, false or auto, got 'maybe'",
        ),
    ],
)
def test_bad_values(cfg, message):
    problems = check_deepspeed_config(cfg, "x")
    assert any(p.startswith(message) for p in problems), problems


@pytest.mark.parametrize("name", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_presets_pass_the_checks(name):
    assert check_deepspeed_config(preset(name), name) == []


def test_auto_and_large_float_bucket_sizes_pass():
    cfg = {
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": "auto",
            "allgather_bucket_size": 5e8,
        }
    }
    assert check_deepspeed_config(cfg, "x") == []


def test_nvme_auto_is_the_roles_directory_and_the_largest_partition():
    built = build_deepspeed_config(
        preset("deepspeed_zero3_nvme"),
        inputs(hidden_size=64, nvme_dir="/nvme/actor_train", largest_numel=1001),
    )
    assert nvme_paths(built) == {
        "offload_optimizer": "/nvme/actor_train",
        "offload_param": "/nvme/actor_train",
    }
    assert built["zero_optimization"]["offload_param"]["buffer_size"] == 501  # ceil(1001 / 2)
    assert built["aio"]["queue_depth"] == 8


def test_nvme_auto_without_a_directory_names_the_key():
    with pytest.raises(DeepSpeedConfigError) as err:
        build_deepspeed_config(preset("deepspeed_zero3_nvme"), inputs(hidden_size=64))
    message = str(err.value)
    assert "zero_optimization.offload_optimizer.nvme_path" in message
    assert "zero_optimization.offload_param.buffer_size" in message


NVME = {"device": "nvme", "nvme_path": "/x"}


@pytest.mark.parametrize(
    ("zero", "aio", "message"),
    [
        (
            {"offload_param": {**NVME, "buffer_count": 0}},
            {},
            "x.zero_optimization.offload_param.buffer_count: must be a number >= 1",
        ),
        (
            {"offload_param": {**NVME, "nvme_path": ""}},
            {},
            "x.zero_optimization.offload_param.nvme_path: NVMe offload needs a directory",
        ),
        ({}, {"queue_depth": 0}, "x.aio.queue_depth: must be a number >= 1"),
        ({}, {"single_submit": "no"}, "x.aio.single_submit: must be true or false"),
    ],
)
def test_bad_nvme_values(zero, aio, message):
    cfg = {"zero_optimization": {"stage": 3, **zero}, "aio": aio}
    problems = check_deepspeed_config(cfg, "x")
    assert any(p.startswith(message) for p in problems), problems


# ZeRO++ -------------------------------------------------------------------------------------

ZEROPP = {
    "zero_hpz_partition_size": 8,
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True,
}


def zeropp(stage: int = 3, **keys) -> dict:
    return {"zero_optimization": {"stage": stage, **(keys or ZEROPP)}}


def test_zeropp_keys_on():
    assert zeropp_keys(zeropp()) == list(ZEROPP)
    assert zeropp_keys(zeropp(zero_hpz_partition_size=1, zero_quantized_weights=False)) == []


def test_zeropp_needs_stage_3():
    (problem,) = check_deepspeed_config(zeropp(stage=2), "x")
    assert problem.startswith(
        "x: zero_optimization.zero_hpz_partition_size, zero_optimization.zero_quantized_weights, "
        "zero_optimization.zero_quantized_gradients are ZeRO++ keys of ZeRO stage 3 (stage is 2)"
    )
    assert check_deepspeed_config(zeropp(), "x") == []


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            zeropp(zero_hpz_partition_size=0),
            "x.zero_optimization.zero_hpz_partition_size: must be a number >= 1",
        ),
        (
            zeropp(zero_quantized_gradients="yes"),
            "x.zero_optimization.zero_quantized_gradients: must be true or false",
        ),
    ],
)
def test_zeropp_bad_values(cfg, message):
    problems = check_deepspeed_config(cfg, "x")
    assert any(p.startswith(message) for p in problems), problems


def test_zeropp_refused_on_cpu():
    (problem,) = zeropp_device_problems(zeropp(zero_quantized_weights=True), "x", "cpu")
    assert problem.startswith("x: zero_optimization.zero_quantized_weights (ZeRO++) need CUDA")
    assert "run with device: cuda" in problem
    assert zeropp_device_problems(zeropp(), "x", "cuda") == []
    assert zeropp_device_problems(zeropp(), "x", "auto") == []  # decided at launch


def test_hpz_against_the_nodes():
    hpz = zeropp(zero_hpz_partition_size=8)
    (one_node,) = zeropp_topology_problems(hpz, "x", [8])
    assert one_node.startswith("x.zero_optimization.zero_hpz_partition_size: 8 on a role whose 8")
    assert "set it to 1" in one_node
    assert zeropp_topology_problems(hpz, "x", [8, 8]) == []
    assert zeropp_topology_problems(zeropp(zero_hpz_partition_size=4), "x", [8, 8]) == []
    (uneven,) = zeropp_topology_problems(zeropp(zero_hpz_partition_size=3), "x", [8, 8])
    assert "3 does not divide the role's ranks per node (8)" in uneven
    # the quantized flags alone are fine on one node
    assert zeropp_topology_problems(zeropp(zero_quantized_weights=True), "x", [8]) == []
