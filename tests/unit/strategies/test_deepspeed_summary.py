"""The start-up log names the ZeRO stage a trainer runs: the one in use, which under LoRA with a
stage-3 config whose frozen base is kept whole is the adapter's lower stage."""

from __future__ import annotations

import logging

from roll_ds.pipeline.startup import log_started
from strategies.deepspeed.train import DeepSpeedTrainStrategy


def strategy(configured: dict, built: dict, world_size: int = 2) -> DeepSpeedTrainStrategy:
    s = DeepSpeedTrainStrategy(model_path="embedded:tiny-qwen2", strategy_config=configured)
    s.ds_config, s.world_size = built, world_size  # what initialize builds
    return s


def test_the_summary_names_the_stage_in_use_offload_and_precision():
    zero3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    assert strategy(zero3, zero3).summary() == (
        "DeepSpeed ZeRO stage 3 on 2 rank(s), offload none, bf16"
    )
    lowered = {"zero_optimization": {"stage": 1}}
    assert (
        strategy(zero3, lowered)
        .summary()
        .startswith(
            "DeepSpeed ZeRO stage 1 on 2 rank(s) (the config's stage 3; frozen base kept whole)"
        )
    )
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert strategy(offloaded, offloaded, 1).summary() == (
        "DeepSpeed ZeRO stage 2 on 1 rank(s), offload optimizer -> cpu, fp32"
    )


def test_the_driver_logs_rank_0_s_summary(caplog):
    with caplog.at_level(logging.INFO, logger="roll_ds.pipeline.startup"):
        log_started("actor_train", [{"rank": 0, "summary": "DeepSpeed ZeRO stage 3 ..."}, {}])
        log_started("rewards.math", [{"rank": 0}])
        log_started("reference", None)
    assert caplog.messages == ["actor_train: DeepSpeed ZeRO stage 3 ..."]
