"""A DeepSpeed preset's precision (``bf16`` / ``fp16`` ``enabled``) against the role's
``model_args.dtype``: an explicit value that disagrees is refused before any actor starts,
naming both and how to align them (``auto`` follows the dtype)."""

from __future__ import annotations

from _config_problems import only

from roll_ds.config import load_config

FIELD = "actor_train.strategy_args.strategy_config"


def test_a_bf16_preset_under_an_fp32_model():
    # was accepted: the run trained in bf16 while rollouts ran in fp32
    assert only("deepspeed_zero3.bf16.enabled=true") == (
        f"{FIELD}.bf16.enabled: true trains actor_train in bf16, but "
        "actor_train.model_args.dtype is fp32: the weights are cast to bf16 for every forward "
        "and backward while the config (and a rollout engine in fp32) says fp32, so the "
        "trainer's log-probs drift from the engine's; align them: bf16.enabled: auto (follows "
        "the dtype) or actor_train.model_args.dtype: bf16 (with actor_infer.model_args.dtype "
        "to match)"
    )


def test_an_fp16_preset_under_a_bf16_model():
    msg = only("actor_train.model_args.dtype=bf16", "deepspeed_zero3.fp16.enabled=true")
    assert msg.startswith(
        f"{FIELD}.fp16.enabled: true trains actor_train in fp16, but actor_train.model_args.dtype "
        "is bf16"
    )


def test_a_disabled_precision_the_dtype_turns_on_anyway():
    assert only("actor_train.model_args.dtype=bf16", "deepspeed_zero3.bf16.enabled=false") == (
        f"{FIELD}.bf16.enabled: false, but actor_train.model_args.dtype is bf16, which trains in "
        "bf16 whatever enabled says; set bf16.enabled: auto, or actor_train.model_args.dtype: "
        "fp32 to train in fp32"
    )


def test_agreeing_precisions_validate():
    for overrides in (
        ["deepspeed_zero3.bf16.enabled=false"],  # fp32: bf16 off, as auto would
        ["actor_train.model_args.dtype=bf16", "deepspeed_zero3.bf16.enabled=true"],
        ["actor_train.model_args.dtype=bf16"],  # auto
    ):
        load_config("rlvr_lora_zero3", overrides, check_files=False)
