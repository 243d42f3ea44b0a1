"""``zero3_frozen_base``: where a stage-3 config keeps a LoRA model's frozen base (whole or
partitioned), resolved by ``build_deepspeed_config`` for each model size, LoRA or not, budget."""

from pathlib import Path

import pytest
import yaml

from roll_ds.config.deepspeed import (
    ADAPTER_STAGE_KEY,
    FROZEN_BASE_BUDGET_FRACTION,
    FROZEN_BASE_KEY,
    DeepSpeedConfigError,
    DeepSpeedInputs,
    build_deepspeed_config,
    check_deepspeed_config,
    frozen_base_whole,
    zero_stage,
)

PRESETS = Path(__file__).resolve().parents[3] / "examples" / "config"
GIB = 2**30


def preset(name: str, **top) -> dict:
    return {**yaml.safe_load((PRESETS / f"{name}.yaml").read_text())[name], **top}


def inputs(**kw) -> DeepSpeedInputs:
    base = dict(
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        dp_size=2,
        max_grad_norm=1.0,
        dtype="bf16",
        hidden_size=512,
        lora=True,
        frozen_base_bytes=14 * GIB,  # a 7B model in bf16
        rank_memory_bytes=80 * GIB,
    )
    return DeepSpeedInputs(**{**base, **kw})


def resolved(cfg: dict, **kw) -> str | None:
    return build_deepspeed_config(cfg, inputs(**kw)).get(FROZEN_BASE_KEY)


@pytest.mark.parametrize(
    ("base_gib", "memory_gib", "expected"),
    [
        (14, 80, "whole"),  # 7B bf16 on an 80 GB GPU: 17.5% of it
        (20, 80, "whole"),  # exactly the budget
        (21, 80, "partitioned"),
        (140, 80, "partitioned"),  # 70B: does not fit
        (14, 40, "partitioned"),
    ],
)
def test_auto_keeps_the_base_whole_when_it_fits_the_budget(base_gib, memory_gib, expected):
    assert FROZEN_BASE_BUDGET_FRACTION == 0.25  # the table above assumes it
    cfg = preset("deepspeed_zero3")
    assert cfg[FROZEN_BASE_KEY] == "auto"
    got = resolved(cfg, frozen_base_bytes=base_gib * GIB, rank_memory_bytes=memory_gib * GIB)
    assert got == expected


def test_auto_partitions_without_lora_unknown_sizes_or_with_parameter_offload():
    cfg = preset("deepspeed_zero3")
    assert resolved(cfg, lora=False, frozen_base_bytes=None) == "partitioned"
    assert resolved(cfg, frozen_base_bytes=None) == "partitioned"
    assert resolved(cfg, rank_memory_bytes=None) == "partitioned"
    assert resolved(preset("deepspeed_zero3_cpuoffload")) == "partitioned"


def test_explicit_modes_override_the_budget():
    huge = dict(frozen_base_bytes=1000 * GIB)
    assert resolved(preset("deepspeed_zero3", **{FROZEN_BASE_KEY: "whole"}), **huge) == "whole"
    assert resolved(preset("deepspeed_zero3_cpuoffload", **{FROZEN_BASE_KEY: "whole"})) == "whole"
    small = preset("deepspeed_zero3", **{FROZEN_BASE_KEY: "partitioned"})
    assert resolved(small, frozen_base_bytes=1) == "partitioned"
    # full fine-tuning has no frozen base: "whole" means nothing there
    assert resolved(preset("deepspeed_zero3", **{FROZEN_BASE_KEY: "whole"}), lora=False) == (
        "partitioned"
    )


def test_resolution_is_read_back_and_dropped_below_stage_3():
    cfg = build_deepspeed_config(preset("deepspeed_zero3", **{ADAPTER_STAGE_KEY: 3}), inputs())
    assert frozen_base_whole(cfg)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * 512
    cfg = preset("deepspeed_zero2", **{FROZEN_BASE_KEY: "whole"})
    zero2 = build_deepspeed_config(cfg, inputs())
    assert FROZEN_BASE_KEY not in zero2 and not frozen_base_whole(zero2)


def test_unknown_mode_is_named():
    cfg = preset("deepspeed_zero3", **{FROZEN_BASE_KEY: "persist"})
    problems = check_deepspeed_config(cfg, "actor_train.strategy_args.strategy_config")
    assert problems == [
        "actor_train.strategy_args.strategy_config.zero3_frozen_base: 'persist' is not one of "
        "auto, whole, partitioned"
    ]
    with pytest.raises(DeepSpeedConfigError, match="zero3_frozen_base"):
        build_deepspeed_config(cfg, inputs())


def built(cfg: dict, **kw) -> dict:
    return build_deepspeed_config(cfg, inputs(**kw))


def lowered(cfg: dict, stage: int = 1) -> bool:
    """A stage-3 config built to run at ``stage``."""
    return cfg.get(ADAPTER_STAGE_KEY) == stage and zero_stage(cfg) == stage


def test_auto_trains_the_adapter_at_stage_1_once_the_base_is_whole():
    cfg = built(preset("deepspeed_zero3"))
    assert cfg[FROZEN_BASE_KEY] == "whole" and cfg[ADAPTER_STAGE_KEY] == 1
    assert zero_stage(cfg) == 1 and lowered(cfg) and frozen_base_whole(cfg)
    zero = cfg["zero_optimization"]
    assert not [k for k in zero if k.startswith("stage3_")] and "sub_group_size" not in zero
    assert zero["reduce_bucket_size"] == 512 * 512  # adapter size unknown: hidden x hidden


def test_auto_trains_the_adapter_at_stage_2_when_the_optimizer_is_offloaded():
    cfg = preset("deepspeed_zero3")
    cfg["zero_optimization"] = {
        **cfg["zero_optimization"],
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
    }
    built_cfg = built(cfg)
    assert frozen_base_whole(built_cfg) and lowered(built_cfg, stage=2)
    explicit = {**cfg, ADAPTER_STAGE_KEY: 1}
    [problem] = check_deepspeed_config(explicit, "actor_train.cfg")
    assert problem.startswith("actor_train.cfg.zero3_adapter_stage: 1 cannot offload")
    assert "zero3_adapter_stage: auto or 2" in problem


@pytest.mark.parametrize(
    ("trainable", "bucket"),
    [(None, 512 * 512), (10_000, 512 * 512), (900_000, 900_000), (10**9, 500_000_000)],
)
def test_with_lora_an_auto_reduce_bucket_holds_the_whole_adapter(trainable, bucket):
    cfg = built(preset("deepspeed_zero3"), trainable_numel=trainable)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == bucket
    full = built(preset("deepspeed_zero3"), lora=False, trainable_numel=trainable)
    assert full["zero_optimization"]["reduce_bucket_size"] == 512 * 512


def test_a_partitioned_base_keeps_the_adapter_at_stage_3():
    for cfg in (
        built(preset("deepspeed_zero3"), frozen_base_bytes=1000 * GIB),
        built(preset("deepspeed_zero3_cpuoffload")),
        built(preset("deepspeed_zero3"), lora=False),
    ):
        assert cfg[FROZEN_BASE_KEY] == "partitioned" and cfg[ADAPTER_STAGE_KEY] == 3
        assert zero_stage(cfg) == 3 and not lowered(cfg)


def test_adapter_stage_3_keeps_the_zero3_engine_with_the_base_whole():
    cfg = built(preset("deepspeed_zero3", **{ADAPTER_STAGE_KEY: 3}))
    assert frozen_base_whole(cfg) and zero_stage(cfg) == 3 and not lowered(cfg)
    assert lowered(built(preset("deepspeed_zero3", **{ADAPTER_STAGE_KEY: 2})), stage=2)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * 512


def test_adapter_stage_key_is_dropped_below_stage_3():
    cfg = built(preset("deepspeed_zero2", **{ADAPTER_STAGE_KEY: 2}))
    assert ADAPTER_STAGE_KEY not in cfg and not lowered(cfg)


@pytest.mark.parametrize(
    ("top", "message"),
    [
        ({ADAPTER_STAGE_KEY: 4}, "zero3_adapter_stage: 4 is not one of auto, 1, 2, 3"),
        ({ADAPTER_STAGE_KEY: True}, "zero3_adapter_stage: True is not one of auto, 1, 2, 3"),
        (
            {ADAPTER_STAGE_KEY: 2, FROZEN_BASE_KEY: "partitioned"},
            "zero3_adapter_stage: 2 needs the frozen base whole, but zero3_frozen_base is "
            "partitioned",
        ),
        (
            {ADAPTER_STAGE_KEY: 1, FROZEN_BASE_KEY: "partitioned"},
            "zero3_adapter_stage: 1 needs the frozen base whole",
        ),
    ],
)
def test_bad_adapter_stage_is_named_with_the_fix(top, message):
    problems = check_deepspeed_config(preset("deepspeed_zero3", **top), "actor_train.cfg")
    assert len(problems) == 1 and problems[0].startswith(f"actor_train.cfg.{message}")
    with pytest.raises(DeepSpeedConfigError, match="zero3_adapter_stage"):
        build_deepspeed_config(preset("deepspeed_zero3", **top), inputs())
